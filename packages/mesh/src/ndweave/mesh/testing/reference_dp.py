"""``ReferenceDataParallel``: the data-parallel contract in its plainest form, for tests.

It implements :class:`ndweave.mesh.contracts.DataParallelWrapper` with no hooks and no overlap, so a
test of something that *drives* a data-parallel wrapper (a sharded optimizer, a pipeline schedule)
can run against a wrapper whose every line is easy to follow::

    from ndweave.mesh.testing import ReferenceDataParallel

    model = ReferenceDataParallel(model, mesh["DP"], use_distributed_optimizer=True, bucket_size=64)
    for i, (x, y) in enumerate(micro_batches):
        model.set_is_last_microbatch(i == k - 1)
        (loss_fn(model(x), y) / k).backward()        # autograd accumulates into .grad
    model.finish_grad_sync()                         # all the communication happens here
    ...
    model.zero_grad_buffer()

How it differs from ``ndweave.ddp``: grads accumulate in ``.grad`` as autograd leaves them, and
everything happens in ``finish_grad_sync()`` (the contract lets a wrapper launch its reductions
there). The micro-batch flag (``is_last_microbatch``, from ``MicroBatchControl``) is kept but
changes nothing. One
``finish_grad_sync()`` per step: call ``zero_grad_buffer()`` (optimizers' ``zero_grad()`` do) before
the next step's backward; nothing is carried across steps. Every rank must build the same initial
parameters (no broadcast). DTensor params must live on meshes without the data-parallel dim (the TP
submesh, say).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ndweave.mesh.collectives import reduce_scatter_flat
from ndweave.mesh.contracts import (
    BUCKET_ALIGNMENT,
    BucketParam,
    GradBucket,
    GradReduction,
    MicroBatchControl,
    move_param_into,
    padded_bucket_numel,
    slot_numel,
)
from ndweave.mesh.torch_compat import local_tensor

__all__ = ["ReferenceDataParallel"]


class ReferenceDataParallel(MicroBatchControl, torch.nn.Module):
    """A simple, slow, obviously correct data-parallel wrapper (see the module docstring).

    Args:
        module: the model; plain params and DTensor params (on meshes without the DP dim).
        data_parallel: the 1-D data-parallel ``DeviceMesh`` or its ``ProcessGroup``; ``None`` for one
            rank (no communication).
        bucket_size: a bucket closes once its slots hold at least this many elements; ``None`` for
            one bucket per (device, dtype).
        use_distributed_optimizer: lay the params out in ``param_data`` buffers and reduce-scatter, so
            DP rank ``r`` holds reduced grads only in its ``shard_range`` of each bucket (then no
            ``.grad`` is set); otherwise all-reduce and set every param's ``.grad``.
        grad_reduction: ``"mean"`` or ``"sum"`` of the grads over the data-parallel ranks.
        grad_dtype: dtype of the grad buffers (default: the params'), e.g. fp32 for a bf16 model.
        alignment: each DP rank's range of a bucket is a multiple of this many elements (as in
            ``ndweave.ddp``); ``1`` packs a small test model's buckets tightly, so that every rank
            owns some parameters.
        reduce_whole: with ``use_distributed_optimizer``, all-reduce whole buckets instead (as
            ``ndweave.ddp`` does on gloo) and mark them ``reduced_whole``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        data_parallel: DeviceMesh | dist.ProcessGroup | None = None,
        *,
        bucket_size: int | None = None,
        use_distributed_optimizer: bool = False,
        grad_reduction: GradReduction = "mean",
        grad_dtype: torch.dtype | None = None,
        alignment: int = BUCKET_ALIGNMENT,
        reduce_whole: bool = False,
    ) -> None:
        super().__init__()
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
        self.module = module
        group = data_parallel.get_group() if isinstance(data_parallel, DeviceMesh) else data_parallel
        self.data_parallel_size = 1 if group is None else dist.get_world_size(group)
        self.data_parallel_group = group if self.data_parallel_size > 1 else None
        self.use_distributed_optimizer = use_distributed_optimizer
        self._grad_reduction: GradReduction = grad_reduction
        self._synced = False
        self._alignment = alignment
        self._reduce_whole = reduce_whole or not use_distributed_optimizer  # (all-reduced whole)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._buckets = [self._build_bucket(chunk, grad_dtype) for chunk in _chunks(named, bucket_size)]

    def _build_bucket(self, chunk: list[tuple[str, torch.nn.Parameter]], grad_dtype: torch.dtype | None) -> GradBucket:
        # The shared layout rules: a slot per param as large as its largest TP peer's shard, the
        # bucket padded to a multiple of the DP size (times an alignment). The rest stays zero.
        offsets, size = [], 0
        for _, p in chunk:
            offsets.append(size)
            size += slot_numel(p)
        numel = padded_bucket_numel(size, self.data_parallel_size, self._alignment)
        first = local_tensor(chunk[0][1])
        grad_data = torch.zeros(numel, dtype=grad_dtype or first.dtype, device=first.device)
        param_data = torch.zeros(numel, dtype=first.dtype, device=first.device) if self.use_distributed_optimizer else None
        params = []
        for (name, p), offset in zip(chunk, offsets):
            if param_data is not None:
                move_param_into(p, param_data, offset)  # the param's local tensor becomes a view
            params.append(BucketParam(name, p, offset, local_tensor(p).numel()))
        return GradBucket(tuple(params), grad_data, param_data, self.data_parallel_group, self._reduce_whole)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ---- the contract
    @property
    def grad_reduction(self) -> GradReduction:
        return self._grad_reduction

    def grad_buckets(self) -> Sequence[GradBucket]:
        return tuple(self._buckets)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Copy every param's accumulated local grad into its bucket, reduce each bucket over DP and
        (without a sharded layout) point ``.grad`` at the result. A second call does nothing."""
        if self._synced:
            return
        for bucket in self._buckets:
            for bp in bucket.params:
                region = bucket.grad_data[bp.offset : bp.offset + bp.numel]
                grad = bp.param.grad
                if grad is None:  # unused this step: contributes zeros
                    region.zero_()
                    continue
                if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(bp.param.placements):
                    # e.g. Partial over TP where the param is Replicate: reduce over TP first (one
                    # collective per param: slow, but every rank issues them in the same order)
                    grad = grad.redistribute(bp.param.device_mesh, bp.param.placements)
                region.copy_(local_tensor(grad).reshape(-1))
            # padding is never written: it stays zero through every reduction
            self._reduce(bucket)
            for bp in bucket.params:
                bp.param.grad = None if bucket.param_data is not None else _grad_view(bucket, bp)
        self._synced = True

    def _reduce(self, bucket: GradBucket) -> None:
        if bucket.data_parallel_group is None:
            return
        if self._grad_reduction == "mean":  # divide first: gloo has no AVG
            bucket.grad_data.div_(self.data_parallel_size)
        if bucket.param_data is not None and not bucket.reduced_whole:
            start, end = bucket.shard_range()
            reduce_scatter_flat(bucket.grad_data[start:end], bucket.grad_data, group=bucket.data_parallel_group)
        else:
            dist.all_reduce(bucket.grad_data, group=bucket.data_parallel_group)

    def zero_grad_buffer(self) -> None:
        """Zero every grad buffer, drop the params' ``.grad`` and start a new step."""
        for bucket in self._buckets:
            bucket.grad_data.zero_()
            for bp in bucket.params:
                bp.param.grad = None
        self._synced = False


def _chunks(named: list[tuple[str, torch.nn.Parameter]], bucket_size: int | None):
    """Params grouped by (device, dtype) in registration order, cut once a chunk reaches ``bucket_size``."""
    groups: dict[tuple, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in named:
        groups.setdefault((local_tensor(p).device, p.dtype), []).append((name, p))
    limit = math.inf if bucket_size is None else max(1, bucket_size)
    for members in groups.values():
        chunk, size = [], 0
        for name, p in members:
            chunk.append((name, p))
            size += slot_numel(p)
            if size >= limit:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk


def _grad_view(bucket: GradBucket, bp: BucketParam) -> torch.Tensor:
    """``.grad`` for ``bp.param``: its reduced region of ``grad_data`` (a DTensor like the param)."""
    param = bp.param
    local = local_tensor(param)
    grad = bucket.grad_data[bp.offset : bp.offset + bp.numel].view(local.shape).to(param.dtype)
    if isinstance(param, DTensor):
        grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return grad
