"""ZeRO-2 (``DDP(..., zero_stage=2)``): each rank keeps only its range of every bucket's grads.

With ``zero_stage=1`` (``use_distributed_optimizer=True``) backward accumulates into a full-size grad
buffer that lives for the whole run, and only the reduce-scatter cuts it to this rank's range. Here
the persistent buffer is that range alone (the bucket's ``grad_data``: 1/DP of the grads); a
bucket's full-size buffer exists only while a micro-batch fills it and its reduce-scatter runs:

1. the first grad of a micro-batch that reaches a bucket allocates it (zeros, so padding and params
   without a grad count as zero) and points the bucket's slots into it;
2. once the bucket is complete (in bucket order, as ever), it is reduce-scattered: into the shard
   directly for the step's first micro-batch, else in place, then added to the shard (on gloo it is
   all-reduced in place, then copied or added: cheaper there, see ``sync.reduces_by_all_reduce``);
3. at most :data:`MAX_IN_FLIGHT` reductions run at once: launching one more waits for the oldest,
   adds it and frees its buffer, so about ``MAX_IN_FLIGHT + 1`` buckets are alive during backward;
4. at the end of every backward, whatever is left is launched and waited for.

Within one backward a freed buffer is kept for the next bucket it can hold (zeroed again), so a
backward allocates about ``MAX_IN_FLIGHT + 1`` buffers, not one per bucket, with the same peak; none
is kept past the backward, so the forward of the next micro-batch holds none.

**Gradient accumulation: a reduce-scatter per micro-batch** (DeepSpeed's ZeRO-2 does the same). There
is nowhere to keep a micro-batch's local sum without a full-size buffer, so each backward reduces
its own grads into the shard (the sum over micro-batches of the reduced grads, which equals the
reduction of the summed grads). The price: ``k`` micro-batches cost ``k`` reduce-scatters of the
grads per step instead of one. Where memory allows, ``zero_stage=1`` accumulates locally and reduces
once. With ``overlap_grad_reduce=False`` every bucket is reduced at the end of backward, so they
are all alive together then (peak grad memory as ``zero_stage=1``, only shorter-lived).

``Partial`` grads on non-DP mesh dims (sequence parallel) are reduced once per step on the shard's
pieces: tensor-parallel peers hold the same DP coordinate, so the same ranges (the layout rule
:func:`~ndweave.mesh.contracts.slot_numel` keeps their offsets equal).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ndweave.ddp.buffer import ParamSlot
from ndweave.ddp.sync import partial_placements, reduces_by_all_reduce
from ndweave.mesh.collectives import reduce_scatter_flat
from ndweave.mesh.contracts import GradBucket, reduce_partial_grads
from ndweave.mesh.torch_compat import local_tensor

__all__ = ["GradShards", "MAX_IN_FLIGHT"]

#: Reductions in flight at once: two lets one bucket's reduce-scatter overlap the backward that
#: fills the next while bounding the full-size buckets alive to about three.
MAX_IN_FLIGHT = 2


@dataclass(eq=False)
class _Reduction:
    """A launched reduction of one bucket's full-size buffer."""

    index: int
    work: dist.Work
    reduced: torch.Tensor | None
    """The reduced range to put in the shard once done (``None``: the shard was the output)."""
    add: bool
    """Add ``reduced`` to the shard (a later micro-batch) rather than copy it (the step's first)."""


@dataclass(eq=False)
class _Piece:
    """A 1-D piece of a shard standing in for a parameter in ``reduce_partial_grads`` (which reads
    ``.grad``, ``shape`` and ``stride()`` and writes the reduced values into the grad's local tensor)."""

    grad: torch.Tensor
    shape: torch.Size

    def stride(self) -> tuple[int, ...]:
        return (1,)


class GradShards:
    """The full-size bucket buffers of the micro-batch in progress and their reductions into the
    buckets' ``grad_data`` (this rank's range). One per ZeRO-2 wrapper."""

    def __init__(self, buckets: list[GradBucket], bucket_slots: list[list[ParamSlot]]) -> None:
        self.buckets = buckets
        self.bucket_slots = bucket_slots
        self.full: list[torch.Tensor | None] = [None] * len(buckets)
        self._bases: list[torch.Tensor | None] = [None] * len(buckets)  # the allocation each full buffer starts
        self._spare: list[torch.Tensor] = []  # freed in this backward, for the next bucket that fits
        # per slot of each bucket, where its view lies in the full buffer (the slots follow bp order)
        self._views = [[(bp.offset, bp.numel, local_tensor(bp.param).shape) for bp in b.params] for b in buckets]
        self._written = [False] * len(buckets)  # the shard holds this step's sum so far (add, not overwrite)
        self._pending: deque[_Reduction] = deque()
        self._all_reduces = [reduces_by_all_reduce(b.data_parallel_group) for b in buckets]

    def open(self, index: int) -> None:
        """Give bucket ``index`` a zeroed full-size buffer (if it has none) and its slots views of it."""
        if self.full[index] is not None:
            return
        shard, numel = self.buckets[index].grad_data, self.buckets[index].numel
        spare = next((i for i, base in enumerate(self._spare)
                      if base.numel() >= numel and base.dtype == shard.dtype), None)
        if spare is None:
            base = torch.zeros(numel, dtype=shard.dtype, device=shard.device)
        else:
            base = self._spare.pop(spare)
            base[:numel].zero_()
        self._bases[index], full = base, base[:numel]
        self.full[index] = full
        for slot, (offset, numel, shape) in zip(self.bucket_slots[index], self._views[index]):
            slot.main_grad = full[offset:offset + numel].view(shape)
            slot.fresh = True  # the zeros are this micro-batch's start: the first grad is copied in

    def launch(self, index: int, op: dist.ReduceOp) -> None:
        """Reduce bucket ``index``'s full buffer into its shard (async over a group; no group: added now)."""
        self.open(index)
        bucket, full = self.buckets[index], self.full[index]
        start, end = bucket.shard_range()
        first, self._written[index] = not self._written[index], True
        if bucket.data_parallel_group is None:
            if first:
                bucket.grad_data.copy_(full)
            else:
                bucket.grad_data.add_(full)
            self._free(index)
            return
        if self._all_reduces[index]:
            work = dist.all_reduce(full, op=op, group=bucket.data_parallel_group, async_op=True)
            reduced = full[start:end]
        else:
            reduced = None if first else full[start:end]
            work = reduce_scatter_flat(bucket.grad_data if first else reduced, full, op=op,
                                       group=bucket.data_parallel_group, async_op=True)
        self._pending.append(_Reduction(index, work, reduced, add=not first))
        self.wait(keep=MAX_IN_FLIGHT)

    def wait(self, keep: int = 0) -> None:
        """Finish the oldest reductions until at most ``keep`` are in flight."""
        while len(self._pending) > keep:
            reduction = self._pending.popleft()
            reduction.work.wait()
            if reduction.reduced is not None:
                shard = self.buckets[reduction.index].grad_data
                if reduction.add:
                    shard.add_(reduction.reduced)
                else:
                    shard.copy_(reduction.reduced)
            self._free(reduction.index)
        if not keep:
            self._spare.clear()  # the backward's end: no buffer outlives it

    def start_step(self) -> None:
        """A new step: the first reduction of each bucket overwrites its shard."""
        self._written = [False] * len(self.buckets)

    def reset(self) -> None:
        """Wait for what is in flight and drop every full-size buffer (``zero_grad_buffer()``)."""
        self.wait()
        for index in range(len(self.buckets)):
            self._free(index)
        self.start_step()

    def _free(self, index: int) -> None:
        if self._bases[index] is not None:
            self._spare.append(self._bases[index])
        self.full[index] = self._bases[index] = None
        for slot in self.bucket_slots[index]:
            slot.main_grad = None  # (a view would keep the buffer alive)

    def reduce_partial(self) -> None:
        """Reduce the shard's pieces of grads still ``Partial`` on non-DP mesh dims, once per step."""
        pieces = []
        for bucket, slots in zip(self.buckets, self.bucket_slots):
            start, end = bucket.shard_range()
            for bp, slot in zip(bucket.params, slots):
                placements = partial_placements(slot)
                lo, hi = max(start, bp.offset), min(end, bp.offset + bp.numel)
                if placements is None or lo >= hi:
                    continue
                piece = bucket.grad_data[lo - start:hi - start]
                # only the Partial dims matter to the reduction; the piece is 1-D, so the rest say Replicate
                placements = [pl if pl.is_partial() else Replicate() for pl in placements]
                grad = DTensor.from_local(piece, slot.param.device_mesh, placements, run_check=False,
                                          shape=piece.shape, stride=(1,))
                pieces.append(_Piece(grad, piece.shape))
        if pieces:
            reduce_partial_grads(pieces)
