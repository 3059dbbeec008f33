"""Flat gradient (and parameter) buffers, split into buckets.

Layout (Megatron's): parameters are grouped by (device, param dtype, grad dtype, the group their grads
are reduced over: dense and expert params apart, as Megatron keeps expert buffers apart); inside a group
they are laid out in *reverse registration order*, which is roughly the order backward produces
their grads, and cut into buckets of at least ``bucket_size`` elements (a parameter is never split
between buckets). The two layout rules every data-parallel wrapper shares come from
``ndweave.mesh.contracts``: each bucket is padded to a multiple of the data-parallel size times an
alignment (:func:`~ndweave.mesh.contracts.padded_bucket_numel`), which lets a reduce-scatter hand
every DP rank an equal contiguous range, and an unevenly sharded parameter's slot is as large as its
largest peer shard (:func:`~ndweave.mesh.contracts.slot_numel`), so tensor-parallel peers share one
layout.

Each group owns one contiguous grad buffer; a bucket's ``grad_data`` and every parameter's grad view
are slices of it. With ``use_distributed_optimizer=True`` a matching parameter buffer is built too and
every parameter's (local) tensor is re-pointed into it, so a sharded optimizer can write its range of
``param_data`` and all-gather it straight into the live parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.mesh.contracts import BucketParam, GradBucket, move_param_into, padded_bucket_numel, slot_numel
from ndweave.mesh.torch_compat import local_tensor

__all__ = ["BucketPlan", "BufferPlan", "ParamSlot", "build_buckets", "lay_out_for_compile", "plan_buckets",
           "plan_buffers"]


@dataclass(eq=False)
class ParamSlot:
    """Everything the wrapper tracks about one synced parameter (one per parameter, never copied).

    A slot also quacks like a parameter (``grad``, ``shape``, ``stride()``) so that
    :func:`ndweave.mesh.contracts.reduce_partial_grads` can reduce the buffer view it carries in
    ``grad`` without that view ever having to be assigned to the real parameter's ``.grad``.
    """

    name: str
    """FQN in the unwrapped model."""
    param: torch.nn.Parameter
    bucket_index: int
    """Index into the wrapper's global bucket list (launch order)."""
    main_grad: torch.Tensor | None
    """Plain view of the grad buffer, shaped like the param's local tensor (grad dtype). With
    ``zero_stage=2``: a view of its bucket's full-size buffer while a micro-batch fills it, ``None``
    once that buffer is reduced and freed (``grad_shard.py``)."""
    reduced_over: int = 1
    """Ranks the bucket's collective sums over (its group's size; 1 without one)."""
    compilable: bool = False
    """Publish DTensor grads that ``torch.compile`` can fake (the model holds compiled modules)."""
    dp_mesh_dim: int | None = None
    """Which dim of a DTensor param's mesh spans the bucket's group, if its mesh includes it."""
    grad_placements: tuple | None = None
    """Placements grads are accumulated in: the param's, except ``Partial`` kept where the param is
    ``Replicate`` (those are reduced at ``finish_grad_sync``). Fixed by the first grad seen."""
    scale: float = 1.0
    """Factor applied when a grad is accumulated into the buffer (1 / the ranks that split the batch,
    when averaging)."""
    carry_scale: float = 1.0
    """Factor for a grad carried over from the last step (undoes every sum the sync applies)."""
    fresh: bool = True
    """True until the first grad of this step lands: it is copied (not added), no zeroing needed."""
    ready: bool = False
    """This step's sync micro-batch delivered the grad (counted towards its bucket)."""
    published: torch.Tensor | None = None
    """The ``.grad`` last handed to the user; recognised by identity at the next step."""
    unscaled: bool = False
    """The region holds a local (``no_sync``) sum not yet multiplied by ``scale``."""
    local_view: torch.Tensor | None = None
    """The ``.grad`` handed out after a ``no_sync`` micro-batch: a view of the local sum, as torch's
    DDP has it there; recognised by identity (a user's ``zero_grad()`` drops it)."""
    local_main: torch.Tensor | None = None
    """Cached DTensor (or plain) view of ``main_grad`` with ``grad_placements``: the ``local_view``
    handed out (building a DTensor costs ~85 us, too much per param per micro-batch)."""
    published_main: torch.Tensor | None = None
    """Cached DTensor (or plain) view of ``main_grad`` with the param's placements."""
    partial_grad: torch.Tensor | None = None
    """Cached DTensor view of ``main_grad`` with ``grad_placements`` (only when one is Partial)."""
    grad: torch.Tensor | None = field(default=None, repr=False)
    """Scratch for ``reduce_partial_grads`` (see the class docstring)."""

    @property
    def shape(self) -> torch.Size:
        return self.param.shape

    def stride(self) -> tuple[int, ...]:
        return self.param.stride()


@dataclass(frozen=True)
class BucketPlan:
    """Where one bucket lies in its group's flat buffer, computed before any buffer exists."""

    start: int
    """First element of the bucket in the group's buffer."""
    end: int
    """One past its last element, padding included (``end - start`` is ``padded_bucket_numel``)."""
    entries: tuple[tuple[str, int, int], ...]
    """``(name, offset in the bucket, local numel)`` of each parameter, in layout order."""


def plan_buckets(sizes: list[tuple[str, int, int]], *, data_parallel_size: int,
                 bucket_size: int | None) -> list[BucketPlan]:
    """The bucket layout of one buffer group: pure arithmetic, so a memory estimate computes exactly
    what :func:`build_buckets` allocates (it calls this).

    ``sizes``: ``(name, local numel, slot numel)`` per parameter in layout order (reverse
    registration); a bucket closes once it holds ``bucket_size`` slot elements (``None``: one bucket)
    and is padded for ``data_parallel_size`` ranks (:func:`~ndweave.mesh.contracts.padded_bucket_numel`).

        plan_buckets([("fc2.weight", 32, 32), ("fc1.weight", 64, 64)], data_parallel_size=2, bucket_size=40)
    """
    limit = math.inf if bucket_size is None else max(1, int(bucket_size))
    plans: list[BucketPlan] = []
    current: list[tuple[str, int, int]] = []
    size = start = 0
    for name, numel, slot in sizes:
        current.append((name, size, numel))
        size += slot
        if size >= limit:
            plans.append(BucketPlan(start, start + padded_bucket_numel(size, data_parallel_size), tuple(current)))
            start, current, size = plans[-1].end, [], 0
    if current:
        plans.append(BucketPlan(start, start + padded_bucket_numel(size, data_parallel_size), tuple(current)))
    return plans


@dataclass(frozen=True)
class BufferPlan:
    """One group's flat buffers (grad, and param with a distributed optimizer), before they exist."""

    key: Hashable
    """What the caller grouped by beside the dtypes (``build_buckets``: the device and the group)."""
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    data_parallel_size: int
    """Ranks the group's grads are reduced over (each bucket is padded for them)."""
    buckets: tuple[BucketPlan, ...]

    @property
    def numel(self) -> int:
        """Elements of the group's buffer, every bucket's padding included."""
        return self.buckets[-1].end if self.buckets else 0

    def grad_bytes(self, zero_stage: int = 0) -> int:
        """Bytes of the grad buffer DDP keeps: the whole group's, or with ``zero_stage=2`` this rank's
        range of every bucket (1/DP; the full-size buckets in flight are :meth:`bucket_grad_bytes`)."""
        numel = self.numel // self.data_parallel_size if zero_stage >= 2 else self.numel
        return numel * self.grad_dtype.itemsize

    def bucket_grad_bytes(self) -> int:
        """Bytes of the group's largest bucket: with ``zero_stage=2``, what each full-size bucket a
        micro-batch is filling or reducing takes on top of :meth:`grad_bytes` (at most
        ``grad_shard.MAX_IN_FLIGHT`` reducing, plus those being filled, usually one)."""
        return max((b.end - b.start for b in self.buckets), default=0) * self.grad_dtype.itemsize

    def param_bytes(self) -> int:
        """Bytes of the param buffer ``use_distributed_optimizer=True`` builds (params moved into it)."""
        return self.numel * self.param_dtype.itemsize


def plan_buffers(params: Sequence[tuple[str, torch.dtype, int, int, Hashable, int]], *, bucket_size: int | None,
                 grad_dtype_of: Callable[[torch.dtype], torch.dtype]) -> list[BufferPlan]:
    """The buffers :func:`build_buckets` allocates, grouped and bucketed as it does, from sizes alone.

    ``params``: ``(name, param dtype, local numel, slot numel, group key, group size)`` per synced
    parameter in registration order (laid out reversed); params with equal dtypes and group key share
    a buffer. A memory estimate gives what DDP will find (an expert over DP, a dense param over DP x
    EP: two keys), DDP gives its process groups. Example::

        plan_buffers([("w", torch.bfloat16, 4096, 4096, "DP", 8)], bucket_size=None,
                     grad_dtype_of=lambda dt: torch.float32)[0].grad_bytes()   # 4096 * 4, padded for 8
    """
    groups: dict[tuple, list[tuple[str, int, int]]] = {}
    sizes: dict[tuple, int] = {}
    for name, dtype, numel, slot, key, size in reversed(params):
        group = (dtype, grad_dtype_of(dtype), key)
        groups.setdefault(group, []).append((name, numel, slot))
        sizes[group] = size
    return [BufferPlan(key, dtype, grad_dtype, sizes[(dtype, grad_dtype, key)],
                       tuple(plan_buckets(members, data_parallel_size=sizes[(dtype, grad_dtype, key)],
                                          bucket_size=bucket_size)))
            for (dtype, grad_dtype, key), members in groups.items()]


def build_buckets(
    named_params: list[tuple[str, torch.nn.Parameter]],
    *,
    bucket_size: int | None,
    grad_dtype_of,
    group_of: Callable[[str, torch.nn.Parameter], dist.ProcessGroup | None],
    with_param_data: bool,
    shard_grads: bool = False,
    compilable: bool = False,
    trailing: int = 0,
) -> tuple[list[GradBucket], list[ParamSlot], list[torch.Tensor]]:
    """Lay ``named_params`` out in flat buffers; return (buckets, slots, group grad buffers).

    ``named_params`` are in registration order; they are laid out reversed. ``group_of(name, param)``
    is the group its grad is reduced over (``None``: no collective). With ``with_param_data`` the
    params' local tensors are moved into the new parameter buffers (values preserved). With
    ``shard_grads`` (ZeRO-2) the grad buffer holds only this rank's range of each bucket, which is the
    bucket's ``grad_data``, and the slots have no ``main_grad`` yet (``grad_shard.py`` makes them).
    ``compilable``: DTensor params and grads in the buffers are laid out so ``torch.compile`` can fake
    them (``move_param_into``). ``trailing``: elements left after the last bucket of the last buffer
    (its grad dtype; DDP's check rows, carried by that bucket's all-reduce: ``check_wait.CarriedRows``).
    """
    by_name = {name: p for name, p in named_params}
    plans = plan_buffers([(name, p.dtype, local_tensor(p).numel(), slot_numel(p), (local_tensor(p).device, group),
                           1 if group is None else dist.get_world_size(group))
                          for name, p in named_params for group in (group_of(name, p),)],
                         bucket_size=bucket_size, grad_dtype_of=grad_dtype_of)
    buckets: list[GradBucket] = []
    slots: list[ParamSlot] = []
    grad_buffers: list[torch.Tensor] = []
    for number, layout in enumerate(plans, 1):
        (device, data_parallel_group), dp_size, param_dtype = layout.key, layout.data_parallel_size, layout.param_dtype
        shards = dp_size if shard_grads else 1  # (bucket starts and ends divide by dp_size)
        extra = trailing if number == len(plans) else 0
        grad_buffer = torch.zeros(layout.numel // shards + extra, dtype=layout.grad_dtype, device=device)
        param_buffer = torch.zeros(layout.numel, dtype=param_dtype, device=device) if with_param_data else None
        grad_buffers.append(grad_buffer)
        for bucket in layout.buckets:
            grad_data = grad_buffer[bucket.start // shards:bucket.end // shards]
            entries = [(name, by_name[name], offset, n) for name, offset, n in bucket.entries]
            param_data = param_buffer[bucket.start:bucket.end] if param_buffer is not None else None
            bucket_index = len(buckets)
            for name, p, offset, n in entries:
                local = local_tensor(p)
                view = None if shard_grads else grad_data[offset : offset + n].view(local.shape)
                slots.append(ParamSlot(name=name, param=p, bucket_index=bucket_index, main_grad=view,
                                       reduced_over=dp_size, compilable=compilable))
                if param_data is not None:
                    move_param_into(p, param_data, offset, compilable=compilable)
            buckets.append(
                GradBucket(
                    params=tuple(BucketParam(name, p, offset, n) for name, p, offset, n in entries),
                    grad_data=grad_data,
                    param_data=param_data,
                    data_parallel_group=data_parallel_group,
                )
            )
    return buckets, slots, grad_buffers


def lay_out_for_compile(buckets: Sequence[GradBucket], slots: Sequence[ParamSlot]) -> None:
    """Lay buffers built without ``compilable`` out as :func:`build_buckets` does with it (blocks compiled
    after the wrapper was built): DTensor params in ``param_data`` re-pointed at views dynamo can fake,
    and the grads published from now on built the same way (a caller re-publishes those already set)."""
    for bucket in buckets:
        if bucket.param_data is not None:
            for bp in bucket.params:
                if isinstance(bp.param, DTensor):
                    move_param_into(bp.param, bucket.param_data, bp.offset, compilable=True)
    for slot in slots:
        slot.compilable = True
        slot.published_main = slot.partial_grad = None  # (rebuilt, compilable, where next needed)
