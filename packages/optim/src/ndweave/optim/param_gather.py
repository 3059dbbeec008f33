"""All-gathering updated parameters over the data-parallel group, optionally overlapped with the
next forward.

After a sharded step each DP rank has fresh values only in its range of every bucket's
``param_data``; one all-gather per bucket (in place: the input is the rank's own
range of the output) gives every rank every value. With overlap the gathers are issued async and
each bucket is waited on in a forward pre-hook of the first module (in forward order) that owns one
of its params, so the gather of later buckets runs while earlier layers compute.

On gloo the gathers run on a side group of the bucket's DP ranks (``ndweave.mesh.lifecycle.side_group``,
``"optim-param-gather"``), apart from the wrapper's bucket reductions: a rank that skipped a step, or
runs one more, then never pairs its gathers with its peers' reductions (gloo would abort, or sum the
wrong tensors), and the wrapper's check before the step can ride the gathers themselves: each is
waited for through the wrapper's ``StepWaiter`` (bounded, naming the rank that diverged), with no
check collective of its own (``ndweave.mesh.contracts.finish_grad_sync_for_step``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ndweave.mesh.collectives import all_gather_flat
from ndweave.mesh.contracts import GradBucket, StepWaiter
from ndweave.mesh.lifecycle import side_group

__all__ = ["ParamGatherer"]


class ParamGatherer:
    """Issues and waits for the per-bucket parameter all-gathers of one optimizer."""

    def __init__(self, buckets: Sequence[GradBucket], models: Sequence[torch.nn.Module], overlap: bool) -> None:
        self.buckets = list(buckets)
        self.overlap = overlap
        self._groups = [_gather_group(bucket) for bucket in self.buckets]
        self.apart = all(group is not bucket.data_parallel_group or bucket.data_parallel_size == 1
                         for group, bucket in zip(self._groups, self.buckets))
        """Whether every bucket's gather runs apart from the bucket's reductions (may be waited through a
        ``StepWaiter``)."""
        self._handles: dict[int, tuple[dist.Work, StepWaiter | None]] = {}
        self.num_waits = [0] * len(self.buckets)
        """How many times each bucket's pending gather was waited on (diagnostics and tests)."""
        self._hooks = []
        if overlap:
            self._register_hooks(models)

    def _register_hooks(self, models: Sequence[torch.nn.Module]) -> None:
        bucket_of = {id(bp.param): index for index, bucket in enumerate(self.buckets) for bp in bucket.params}
        seen: set[int] = set()
        covered: set[int] = set()
        for model in models:
            for module in model.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                indices = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of})
                if indices:
                    covered.update(indices)
                    self._hooks.append(module.register_forward_pre_hook(self._make_hook(tuple(indices))))
        missing = set(range(len(self.buckets))) - covered
        if missing:  # a bucket no module owns a param of: nothing would ever wait for it
            raise ValueError(f"overlap_param_gather: buckets {sorted(missing)} hold params of no module of the models")

    def _make_hook(self, indices: tuple[int, ...]):
        def hook(module: torch.nn.Module, args) -> None:
            self.wait(indices)

        return hook

    def gather(self, waiters: Sequence[StepWaiter | None] | None = None) -> None:
        """All-gather every bucket's ``param_data``; async (waited on later) with overlap. ``waiters``:
        per bucket, what its gather is waited through (a step's; ``None``: ``Work.wait()``)."""
        self.wait()  # a gather still in flight must land before new values are written
        for index, bucket in enumerate(self.buckets):
            if bucket.data_parallel_size == 1:
                continue
            start, end = bucket.shard_range()
            work = all_gather_flat(bucket.param_data, bucket.param_data[start:end], group=self._groups[index],
                                   async_op=True)
            self._handles[index] = work, None if waiters is None else waiters[index]
        if not self.overlap:  # (waited here, in step(): not counted in num_waits)
            for index in list(self._handles):
                self._wait(index)

    def wait(self, indices: Sequence[int] | None = None) -> None:
        """Wait for the pending gathers of ``indices`` (default: all)."""
        for index in list(self._handles) if indices is None else indices:
            self.num_waits[index] += self._wait(index)

    def _wait(self, index: int) -> bool:
        work, waiter = self._handles.pop(index, (None, None))
        if work is None:
            return False
        if waiter is None:
            work.wait()
        else:
            waiter.wait(work, [self.buckets[index].param_data])
        return True

    def pending(self) -> list[int]:
        """Buckets whose gather was issued and not yet waited on."""
        return sorted(self._handles)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _gather_group(bucket: GradBucket) -> dist.ProcessGroup | None:
    """The group ``bucket``'s parameter gathers run on: a gloo side group of its DP ranks, in the same
    order (the gather lays rank ``r``'s range at ``r``), where the bucket's group is gloo; else the
    bucket's own group (NCCL's: another communicator would cost device memory)."""
    group = bucket.data_parallel_group
    if group is None or bucket.data_parallel_size == 1 or dist.get_backend(group) != "gloo":
        return group
    ranks = dist.get_process_group_ranks(group)
    return side_group(group, "optim-param-gather") if ranks == sorted(ranks) else group
