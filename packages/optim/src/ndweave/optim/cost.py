"""What a ``DistributedOptimizer`` holds on each rank, computed before anything exists.

A memory estimate must not drift from what is allocated, so this is the same arithmetic the
optimizer does: each data-parallel rank owns the ``shard_range`` of every bucket
(:func:`ndweave.mesh.contracts.shard_range`), and within it the elements of each parameter (padding
owns nothing), one flat master per run of consecutive pieces (one param group: the optimizer's runs
also end where the group changes). Per owned element it keeps a master weight unless the model's
dtype already is the master dtype (fp32, or float64), and one value per elementwise state tensor of
the optimizer (Adam: ``exp_avg`` and ``exp_avg_sq``); per run, the optimizer's scalar tensors
(Adam's ``step``). Both found by stepping the optimizer over a probe, fused where the optimizer is.

The bucket layout comes from the data-parallel wrapper's own pure planner (``ndweave.ddp.buffer.
plan_buckets``), given here as plain ``(bucket numel, [(offset, numel), ...])`` pairs, so optim
imports no sibling::

    buckets = [(b.end - b.start, [(off, n) for _, off, n in b.entries]) for b in plan_buckets(...)]
    state_bytes_per_rank(buckets, data_parallel_size=4, dp_rank=0, param_dtype=torch.bfloat16,
                         optimizer=torch.optim.AdamW)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ndweave.mesh.contracts import is_elementwise, shard_range
from ndweave.optim.inner import resolve_optimizer

__all__ = ["OptimizerBytes", "owned_elements", "owned_runs", "state_bytes_per_rank", "state_values_per_element"]


@dataclass(frozen=True)
class OptimizerBytes:
    """One rank's optimizer memory."""

    masters: int
    """Bytes of master weights held apart from the model (0 when the model's dtype is the master's)."""
    state: int
    """Bytes of the inner optimizer's state tensors (``optimizer_state_bytes()``): the elementwise
    ones, plus per-run scalars such as Adam's ``step``."""

    @property
    def total(self) -> int:
        return self.masters + self.state


def owned_elements(bucket_numel: int, entries: Sequence[tuple[int, int]], data_parallel_size: int,
                   dp_rank: int) -> list[int]:
    """Elements of each parameter piece of one bucket that ``dp_rank`` owns (``entries``:
    ``(offset, numel)``; pieces owning nothing and the padding left out)."""
    return [end - start for start, end in _owned_ranges(bucket_numel, entries, data_parallel_size, dp_rank)]


def owned_runs(bucket_numel: int, entries: Sequence[tuple[int, int]], data_parallel_size: int,
               dp_rank: int) -> list[int]:
    """Elements of each run of consecutive owned pieces (no padding between them) of one bucket: one
    flat master each."""
    runs: list[list[int]] = []
    for start, end in _owned_ranges(bucket_numel, entries, data_parallel_size, dp_rank):
        if runs and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return [end - start for start, end in runs]


def _owned_ranges(bucket_numel: int, entries: Sequence[tuple[int, int]], data_parallel_size: int,
                  dp_rank: int) -> list[tuple[int, int]]:
    lo, hi = shard_range(bucket_numel, data_parallel_size, dp_rank)
    ranges = ((max(lo, offset), min(hi, offset + numel)) for offset, numel in entries)
    return [(start, end) for start, end in ranges if start < end]


def state_values_per_element(optimizer: type[torch.optim.Optimizer], dtype: torch.dtype,
                             optimizer_kwargs: dict[str, Any] | None = None) -> tuple[int, int]:
    """(bytes per element of the elementwise state tensors, bytes of the other tensors, such as Adam's
    ``step``) that ``optimizer`` keeps per parameter of ``dtype`` after a step, built as
    ``DistributedOptimizer`` builds it (fused where torch has the kernel)."""
    kwargs = tuple(sorted((optimizer_kwargs or {"lr": 0.0}).items()))
    try:
        hash(kwargs)
    except TypeError:  # an unhashable hyperparameter: probed every time
        return _probed.__wrapped__(optimizer, dtype, kwargs)
    return _probed(optimizer, dtype, kwargs)


@functools.lru_cache(maxsize=64)  # a planner asks for the same optimizer once per chunk of every layout
def _probed(optimizer: type[torch.optim.Optimizer], dtype: torch.dtype,
            kwargs: tuple[tuple[str, Any], ...]) -> tuple[int, int]:
    spec = resolve_optimizer(optimizer, dict(kwargs))
    spec.fused(dtype, "cpu")
    state = spec.probe_state(0, dtype)
    tensors = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    per_element = sum(v.element_size() for k, v in tensors if is_elementwise(k, v, (2,)))
    fixed = sum(v.numel() * v.element_size() for k, v in tensors if not is_elementwise(k, v, (2,)))
    return per_element, fixed


def state_bytes_per_rank(buckets: Sequence[tuple[int, Sequence[tuple[int, int]]]], *, data_parallel_size: int,
                         dp_rank: int, param_dtype: torch.dtype, optimizer: type[torch.optim.Optimizer],
                         optimizer_kwargs: dict[str, Any] | None = None, grad_to_fp32: bool = True) -> OptimizerBytes:
    """``dp_rank``'s master and state bytes for ``buckets`` (``(bucket numel, [(offset, numel)])``,
    all of ``param_dtype``), as ``DistributedOptimizer(optimizer, ..., grad_to_fp32=)`` allocates them
    (one param group: with several, add the scalars of the extra runs where the groups alternate)."""
    master_dtype = torch.promote_types(param_dtype, torch.float32) if grad_to_fp32 else param_dtype
    runs = [n for numel, entries in buckets for n in owned_runs(numel, entries, data_parallel_size, dp_rank)]
    per_element, per_run = state_values_per_element(optimizer, master_dtype, optimizer_kwargs)
    masters = 0 if master_dtype == param_dtype else sum(runs) * master_dtype.itemsize
    return OptimizerBytes(masters=masters, state=sum(runs) * per_element + len(runs) * per_run)
