"""Global gradient norm over every way a model is split.

The mechanism: every rank sums the squares (or takes the max, for ``inf``) of the gradient elements
it *owns*, then one all-reduce over ``group`` (default: the whole world) combines them. Ownership is
decided so each element of the global model is counted exactly once:

* data parallelism: with :class:`~ndweave.optim.DistributedOptimizer` each rank holds a disjoint
  range of every grad bucket, so all ranks count their range; with
  :class:`~ndweave.optim.BasicOptimizer` the grads are replicated, so only DP rank 0 counts them.
  Both read the group from each bucket: with expert parallelism dense buckets are reduced over
  DP x EP and experts' over DP (the EP ranks hold different experts, so each counts its own);
* tensor parallelism (and any other DTensor mesh dim): ``Shard`` placements hold different elements
  on each rank, so every rank counts its local tensor; on a ``Replicate`` mesh dim only coordinate 0
  counts (no double counting of replicated LayerNorm weights and the like);
* pipeline stages hold different parameters, so every stage counts its own: the world all-reduce
  sums them. A tied weight held by two stages (embedding and LM head) must be counted by one of
  them: the stage holding the second copy marks it with
  :func:`ndweave.mesh.contracts.mark_tied_replica`. Within one rank, tied parameters are the same
  object and are deduplicated by identity.

Plain (non-DTensor) parameters are counted on every rank that holds them, outside DP: replicate a
parameter over tensor-parallel ranks as a ``Replicate`` DTensor (``ndweave.dmodule`` does), not as a
plain tensor. ``ndweave.pipeline``'s engine marks the second copies of tied weights (tested there
with DistributedOptimizer and BasicOptimizer across pipeline stages).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.mesh.contracts import GradBucket

__all__ = ["counts_replica", "global_norm", "clip_by_norm", "whole_on_every_rank"]

def counts_replica(t: torch.Tensor, skip_ranks: tuple[int, ...] | None = None) -> bool:
    """Whether this rank counts ``t``'s local values: ``False`` on a non-zero coordinate of a
    ``Replicate`` mesh dim. A mesh dim whose group's ranks all lie within ``skip_ranks`` (the group of
    the bucket holding ``t``, whose ranks own disjoint ranges of it: the caller decides ownership
    there) is ignored: e.g. a dense param replicated over EP, reduced in a DP x EP bucket."""
    if not isinstance(t, DTensor):
        return True
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(t.placements):
        if not placement.is_replicate() or coordinate[dim] == 0:
            continue
        if skip_ranks is not None and set(dist.get_process_group_ranks(mesh.get_group(dim))) <= set(skip_ranks):
            continue
        return False
    return True


def global_norm(
    grads: Iterable[torch.Tensor], norm_type: float = 2.0, group: dist.ProcessGroup | None = None,
    device: torch.device | None = None, *, collective: bool = True,
) -> torch.Tensor:
    """The ``norm_type`` norm of the owned local ``grads`` of every rank of ``group`` (a collective).

    ``grads`` are plain local tensors this rank owns (see the module docstring); returns a float64
    scalar tensor, identical on every rank. ``collective=False``: the norm of ``grads`` alone, for a
    caller whose ``grads`` are every grad of the group, the same on every rank.
    """
    norm_type = float(norm_type)
    grads = [g for g in grads if g.numel()]
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type}")
    # at least fp32 (bf16 grads), and float64 for a float64 model: the clip coefficient multiplies
    # every grad, so its precision bounds the step's
    dtype = torch.float32
    for g in grads:
        dtype = torch.promote_types(dtype, g.dtype)
    if not grads:
        local = torch.zeros((), device=device, dtype=dtype)
    elif norm_type == math.inf:
        local = torch.stack([g.detach().abs().max().to(dtype) for g in grads]).max()
    else:
        local = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=dtype) for g in grads]).square().sum()
    # reduced and returned in float64 whatever the grads: a rank that owns nothing (only padding) has
    # no dtype of its own, yet every rank must pass the collective the same one and derive the same
    # clip coefficient from the result
    total = local.to(device, torch.float64)
    if collective and dist.is_initialized():
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=group)
    return total if norm_type == math.inf else total.sqrt()


def clip_by_norm(grads: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))``, as torch does."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.device, g.dtype))


def whole_on_every_rank(buckets: Sequence[GradBucket], group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank of ``group`` (default: the world) holds every grad of ``buckets`` alike after
    the sync: each bucket all-reduced whole (``reduced_whole``) over exactly that group, i.e. data
    parallelism alone. The norm is then one rank's own, with no collective."""
    if not buckets or not dist.is_initialized():
        return False
    ranks = sorted(dist.get_process_group_ranks(group or dist.group.WORLD))
    for bucket in buckets:
        own = [dist.get_rank()] if bucket.data_parallel_group is None else dist.get_process_group_ranks(
            bucket.data_parallel_group)
        if not bucket.reduced_whole or sorted(own) != ranks or bucket.grad_data.numel() != bucket.numel:
            return False
    return True
