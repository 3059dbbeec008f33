"""Where each token of a sequence lives under context parallelism (pure arithmetic, no collectives).

A sequence of ``T`` tokens is cut into ``2 * cp`` equal chunks; rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``. Under a causal mask the work of a query grows with its position, so a head chunk
paired with the matching tail chunk gives every rank the same work (Megatron's and torchtitan's
load balance). ``load_balance=False`` keeps one contiguous chunk per rank (bidirectional attention
has no imbalance to fix, and a reader may want the plain order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ContextParallelError", "SequenceLayout"]


class ContextParallelError(ValueError):
    """What context parallelism cannot split, with the fix."""


@dataclass(frozen=True)
class SequenceLayout:
    """How a sequence of ``seq_len`` tokens is split over ``cp`` ranks."""

    seq_len: int
    """Tokens in the whole sequence (every rank's shard together)."""
    cp: int
    """Ranks of the CP dim."""
    load_balance: bool = True
    """Head-and-tail chunks (True) or one contiguous chunk per rank (False)."""

    def __post_init__(self) -> None:
        pieces = self.pieces
        if self.seq_len % pieces:
            raise ContextParallelError(
                f"context parallel over {self.cp} ranks{' with causal load balance' if self.load_balance else ''} "
                f"cuts each sequence into {pieces} equal chunks, and a sequence of {self.seq_len} tokens does not "
                f"divide into {pieces}: choose a sequence length that is a multiple of {pieces}")

    @property
    def pieces(self) -> int:
        """Chunks per sequence."""
        return 2 * self.cp if self.load_balance else self.cp

    @property
    def local_len(self) -> int:
        """Tokens each rank holds."""
        return self.seq_len // self.cp

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks ``rank`` holds, in the order it holds them."""
        return (rank, 2 * self.cp - 1 - rank) if self.load_balance else (rank,)

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens, in its order: ``(local_len,)`` long."""
        size = self.seq_len // self.pieces
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunks(rank)])

    def gathered_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of every rank's tokens concatenated in rank order (an all-gather's order)."""
        return torch.cat([self.positions(r, device) for r in range(self.cp)])

    def shard(self, tensor: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s tokens of a whole-sequence ``tensor`` (``dim``: its sequence dim)."""
        if tensor.shape[dim] != self.seq_len:
            raise ContextParallelError(f"a tensor of shape {tuple(tensor.shape)} has {tensor.shape[dim]} tokens on dim {dim}, "
                             f"where this layout splits sequences of {self.seq_len}: pass the sequence dim as dim=")
        pieces = tensor.chunk(self.pieces, dim=dim)
        return torch.cat([pieces[c] for c in self.chunks(rank)], dim=dim)

    def unshard(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence in order, from every rank's shard concatenated in rank order on ``dim``."""
        order = torch.argsort(self.gathered_positions(gathered.device))
        return gathered.index_select(dim, order)
