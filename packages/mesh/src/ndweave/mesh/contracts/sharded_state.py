"""The contract between a sharded optimizer (``ndweave.optim``) and checkpointing.

A Megatron-style optimizer shards flat ranges of grad buckets, which cut parameters anywhere, so its
state cannot always be a regular DTensor. Each piece of state a rank holds is described as a
:class:`FlatShard`: enough to place it in the global (unsharded) tensor on any other mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FlatShard"]


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
