"""The grad buckets a data-parallel wrapper (``ndweave.ddp``) hands to a sharded optimizer
(``ndweave.optim``), and the layout rules every wrapper's buckets follow.

The wrapper keeps gradients in contiguous flat buffers split into buckets. Laid out for a sharded
optimizer (Megatron's ``use_distributed_optimizer=True``: its buckets carry ``param_data``), it
reduce-scatters each bucket instead of all-reducing it, so that after ``finish_grad_sync()``
data-parallel rank ``r`` holds the reduced gradient for ``shard_range(bucket.numel, dp_size, r)`` of
every bucket (:meth:`GradBucket.reduced_grad`), and it lays its parameters out
in a matching flat ``param_data`` buffer (each param's local tensor is a view into it). The sharded
optimizer keeps fp32 master weights and state for its ranges only, steps them, writes the result into
its range of ``param_data`` and all-gathers ``param_data`` over the data-parallel group.

Ranges ignore parameter boundaries (Megatron's layout): a parameter may be split between ranks.
A wrapper may keep only that range of the grads (ZeRO-2: ``grad_data`` is then this rank's range,
``param_data`` still the whole bucket).

Layout rules (:func:`padded_bucket_numel`, :func:`slot_numel`), shared so that every wrapper's
buckets split the same way: a bucket's numel is a multiple of ``dp_size * BUCKET_ALIGNMENT``, and a
tensor-parallel parameter's slot is as large as the largest shard any of its peers holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.mesh.torch_compat import is_shard_like, local_tensor, own_storage_view

__all__ = [
    "BUCKET_ALIGNMENT",
    "BucketParam",
    "GradBucket",
    "move_param_into",
    "padded_bucket_numel",
    "shard_range",
    "slot_numel",
]

#: Each data-parallel rank's range of a bucket is a multiple of this many elements: 64 fp32
#: elements are 256 bytes, the alignment at which accelerator collectives run fastest.
BUCKET_ALIGNMENT = 64


@dataclass(frozen=True)
class BucketParam:
    """Where one parameter lives inside a bucket."""

    name: str
    """Fully qualified name in the unwrapped model (no ``module.`` prefix)."""
    param: torch.nn.Parameter
    """The parameter itself; a DTensor when tensor-parallel (the buffer holds its local shard)."""
    offset: int
    """First element of the parameter's local tensor within the bucket's flat buffers."""
    numel: int
    """Number of local elements (``param.to_local().numel()`` for a DTensor)."""


@dataclass
class GradBucket:
    """One bucket of a data-parallel gradient buffer."""

    params: tuple[BucketParam, ...]
    """The parameters in the bucket, in buffer order. Elements no parameter covers are padding
    (zero); tensor-parallel peers see the same offsets even where their shards differ in size."""
    grad_data: torch.Tensor
    """1-D gradient buffer (may be fp32 for a bf16 model): the whole bucket, numel divisible by the DP
    size (:func:`padded_bucket_numel`); or, where the wrapper keeps gradient shards (ZeRO-2, with
    ``param_data``), only this rank's ``shard_range`` of it."""
    param_data: torch.Tensor | None
    """1-D parameter buffer of the same numel whose views are the params' local tensors, when the
    wrapper is laid out for a sharded optimizer (only this rank's ``shard_range`` of ``grad_data`` is
    then reduced); ``None`` when it all-reduces whole buckets."""
    data_parallel_group: dist.ProcessGroup | None
    """Group the bucket is reduced over; ``None`` for a DP size of 1."""
    reduced_whole: bool = False
    """After ``finish_grad_sync()`` every DP rank holds the whole reduced ``grad_data``, the same on
    each (the wrapper all-reduced it, as DDP does on gloo even for a sharded optimizer): a consumer
    may read any range of it, not only ``shard_range()``, without a collective. ``False`` promises
    nothing beyond :meth:`reduced_grad`."""

    @property
    def data_parallel_size(self) -> int:
        return 1 if self.data_parallel_group is None else dist.get_world_size(self.data_parallel_group)

    @property
    def data_parallel_rank(self) -> int:
        return 0 if self.data_parallel_group is None else dist.get_rank(self.data_parallel_group)

    @property
    def numel(self) -> int:
        """Elements of the whole bucket, padding included (``param_data``'s where there is one: a
        ZeRO-2 ``grad_data`` holds one rank's range only)."""
        return (self.grad_data if self.param_data is None else self.param_data).numel()

    def shard_range(self, dp_rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of the bucket owned by ``dp_rank`` (default: this rank)."""
        rank = self.data_parallel_rank if dp_rank is None else dp_rank
        return shard_range(self.numel, self.data_parallel_size, rank)

    def reduced_grad(self) -> torch.Tensor:
        """This rank's reduced grads after ``finish_grad_sync()``: ``grad_data[shard_range()]`` with
        ``param_data`` (all of ``grad_data`` where it holds only that range), else all of ``grad_data``."""
        if self.param_data is None or self.grad_data.numel() != self.numel:
            return self.grad_data
        start, end = self.shard_range()
        return self.grad_data[start:end]


def shard_range(numel: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Equal contiguous ranges; ``numel`` must divide by ``dp_size`` (buckets are padded so it does)."""
    if numel % dp_size:
        raise ValueError(f"a bucket of {numel} elements cannot be split evenly over {dp_size} data-parallel ranks")
    size = numel // dp_size
    return dp_rank * size, (dp_rank + 1) * size


def padded_bucket_numel(numel: int, dp_size: int, alignment: int = BUCKET_ALIGNMENT) -> int:
    """``numel`` rounded up to a multiple of ``dp_size * alignment``: every DP rank's range of the
    bucket then has the same size (what a reduce-scatter needs) and starts aligned."""
    step = dp_size * alignment
    return -(-numel // step) * step


def slot_numel(param: torch.Tensor) -> int:
    """Elements a parameter's slot in a bucket takes: its local numel, or for a DTensor the largest
    local shard any of its peers holds (the rest of the slot is padding).

    A sharded optimizer reduces ``Partial`` grads over whole local tensors after the DP
    reduce-scatter, which is only right when tensor-parallel peers own the same elements of each
    bucket. With uneven shards (a 50257-row vocab over TP=2: 25129 and 25128 rows) local sizes
    differ, so every rank reserves the largest one: offsets and bucket sizes then agree across peers.
    torch chunks the first pieces largest, so the largest is a ceiling division per sharded dim,
    known to every rank without communication.
    """
    if not isinstance(param, DTensor):
        return param.numel()
    shape = list(param.shape)
    for mesh_dim, placement in enumerate(param.placements):
        if is_shard_like(placement):
            shape[placement.dim] = -(-shape[placement.dim] // param.device_mesh.size(mesh_dim))
    return max(math.prod(shape), local_tensor(param).numel())


@torch.no_grad()
def move_param_into(param: torch.nn.Parameter, param_data: torch.Tensor, offset: int, *,
                    compilable: bool = False) -> None:
    """Make ``param``'s local tensor a view of ``param_data`` at ``offset``, keeping its values: how a
    wrapper laid out for a sharded optimizer makes its ``param_data`` views *be* the parameters.
    ``compilable``: a DTensor's local tensor is over that memory at offset 0 of a storage of its own
    (``torch_compat.own_storage_view``), which ``torch.compile`` can fake; a tracker of live storages
    then counts it once more."""
    local = local_tensor(param)
    shape = local.shape
    target = param_data[offset : offset + local.numel()].view(shape)
    target.copy_(local)
    if isinstance(param, DTensor):
        # A DTensor keeps its shard as a separate local tensor; re-point that tensor in place so every
        # reference to it (the param, optimizer state keyed by the param) sees the buffer
        shared = own_storage_view(target) if compilable else target
        local.set_(shared.untyped_storage(), shared.storage_offset(), shape, target.stride())
    else:
        param.data = target
