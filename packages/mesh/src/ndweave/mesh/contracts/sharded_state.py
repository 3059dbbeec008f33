"""The contract between a sharded optimizer (``ndweave.optim``) and checkpointing.

A Megatron-style optimizer shards flat ranges of grad buckets, which cut parameters anywhere, so its
state cannot always be a regular DTensor. Each piece of state a rank holds is described as a
:class:`FlatShard`: enough to place it in the global (unsharded) tensor on any other mesh.

Two pure functions turn shards into full tensors and back, so a checkpoint written by 4
data-parallel ranks loads on 2 or on one device::

    shards = [rank_shard for every rank]                 # FlatShards of one parameter's "exp_avg"
    full = merge_flat_shards(shards)                     # the global tensor
    mine = slice_flat_shard(full, start, end, local_shape, local_offset)   # any other layout's range

A sharded optimizer's ``state_dict()`` uses them as ``{"state": {fqn: {key: FlatShard | scalar}},
"param_groups": [{..., "params": [fqn, ...]}]}``; a value may also be a list of FlatShards (the union
of several ranks') or a full tensor of the parameter's global shape.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["FlatShard", "merge_flat_shards", "slice_flat_shard"]


@dataclass
class FlatShard:
    """A contiguous range of one parameter's flattened *local* tensor, held by one DP rank.

    For a tensor-parallel parameter the local tensor is this rank's TP shard, itself located in the
    global tensor by ``local_offset`` (per-dim offsets, as DTensor computes them).
    """

    fqn: str
    """Parameter's fully qualified name in the unwrapped model."""
    data: torch.Tensor
    """1-D values of the range (``end - start`` elements)."""
    start: int
    """First element of the range within the flattened local tensor."""
    end: int
    """One past the last element."""
    local_shape: tuple[int, ...]
    """Shape of the local tensor (the TP shard, or the whole parameter without TP)."""
    global_shape: tuple[int, ...]
    """Shape of the unsharded parameter."""
    local_offset: tuple[int, ...]
    """Offset of the local tensor within the global tensor, per tensor dim (zeros without TP)."""


def _local_view(full: torch.Tensor, local_shape: Sequence[int], local_offset: Sequence[int]) -> torch.Tensor:
    view = full
    for dim, (offset, size) in enumerate(zip(local_offset, local_shape)):
        view = view.narrow(dim, offset, size)
    return view


def merge_flat_shards(shards: Iterable[FlatShard]) -> torch.Tensor:
    """The global tensor of one parameter's state from FlatShards that together cover it.

    Shards may repeat (tensor-parallel replicas hold identical copies); every element of the global
    tensor must be covered by at least one, else ``ValueError``.
    """
    shards = list(shards)
    if not shards:
        raise ValueError("merge_flat_shards needs at least one shard")
    first = shards[0]
    full = torch.zeros(first.global_shape, dtype=first.data.dtype, device=first.data.device)
    covered = torch.zeros(first.global_shape, dtype=torch.bool)
    by_local: dict[tuple, list[FlatShard]] = defaultdict(list)
    for s in shards:
        if s.global_shape != first.global_shape or s.fqn != first.fqn:
            raise ValueError(f"shards of {first.fqn} {first.global_shape} and {s.fqn} {s.global_shape} cannot merge")
        by_local[(tuple(s.local_offset), tuple(s.local_shape))].append(s)
    for (offset, shape), group in by_local.items():
        numel = 1
        for n in shape:
            numel *= n
        local = torch.zeros(numel, dtype=full.dtype, device=full.device)
        mask = torch.zeros(numel, dtype=torch.bool)
        for s in group:
            local[s.start : s.end] = s.data.reshape(-1).to(full.dtype)
            mask[s.start : s.end] = True
        _local_view(full, shape, offset).copy_(local.view(shape))
        view = _local_view(covered, shape, offset)
        view.copy_(view | mask.view(shape))
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise ValueError(f"the shards of {first.fqn} leave {missing} of {covered.numel()} elements uncovered")
    return full


def slice_flat_shard(
    full: torch.Tensor, start: int, end: int, local_shape: Sequence[int], local_offset: Sequence[int]
) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened local tensor at ``local_offset`` of ``full`` (a copy)."""
    return _local_view(full, local_shape, local_offset).reshape(-1)[start:end].clone()
