"""All-gathering updated parameters over the data-parallel group, optionally overlapped with the
next forward.

After a sharded step each DP rank has fresh values only in its range of every bucket's
``param_data``; one all-gather per bucket (in place: the input is the rank's own
range of the output) gives every rank every value. With overlap the gathers are issued async and
each bucket is waited on in a forward pre-hook of the first module (in forward order) that owns one
of its params, so the gather of later buckets runs while earlier layers compute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ndweave.mesh.collectives import all_gather_flat
from ndweave.mesh.contracts import GradBucket

__all__ = ["ParamGatherer"]


class ParamGatherer:
    """Issues and waits for the per-bucket parameter all-gathers of one optimizer."""

    def __init__(self, buckets: Sequence[GradBucket], models: Sequence[torch.nn.Module], overlap: bool) -> None:
        self.buckets = list(buckets)
        self.overlap = overlap
        self._handles: dict[int, dist.Work] = {}
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

    def gather(self) -> None:
        """All-gather every bucket's ``param_data``; async (waited on later) with overlap."""
        self.wait()  # a gather still in flight must land before new values are written
        for index, bucket in enumerate(self.buckets):
            if bucket.data_parallel_size == 1:
                continue
            start, end = bucket.shard_range()
            work = all_gather_flat(bucket.param_data, bucket.param_data[start:end],
                                   group=bucket.data_parallel_group, async_op=self.overlap)
            if self.overlap:
                self._handles[index] = work

    def wait(self, indices: Sequence[int] | None = None) -> None:
        """Wait for the pending gathers of ``indices`` (default: all)."""
        for index in list(self._handles) if indices is None else indices:
            work = self._handles.pop(index, None)
            if work is not None:
                work.wait()
                self.num_waits[index] += 1

    def pending(self) -> list[int]:
        """Buckets whose gather was issued and not yet waited on."""
        return sorted(self._handles)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
