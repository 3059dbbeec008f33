"""Where the data stands, kept so that a resume at another data-parallel size goes on exactly.

**Policy: resume by global sample index.** The data is one global stream of sample indices, the same
whatever the DP size: epoch after epoch, each epoch the dataset's indices in order or in a permutation
drawn from ``(seed, epoch)``. A step consumes the next ``global_batch_size`` samples of the stream and
DP rank ``r`` of ``D`` trains on the ``r``-th of ``D`` equal contiguous slices of them. A checkpoint
stores only how many samples of the stream were trained on (:attr:`DataPosition.samples_seen`), never a
per-rank offset. Resumed at any DP size, the next global batches are the same samples as in the
uninterrupted run, so training continues identically as long as the global batch size is unchanged
(change it and the stream still continues at the right sample, with other batches).

The position counts samples *trained on*: advance it after each optimizer step, not as a data loader
prefetches::

    position = DataPosition()
    sampler = PositionSampler(len(dataset), position, global_batch_size=64,
                              dp_rank=dp_rank, dp_size=dp_size, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=64 // dp_size, sampler=sampler)
    for batch in loader:
        train_step(batch)
        position.advance(64)
        if step % 1000 == 0:
            save(path, {"model": model, "optimizer": opt, "data": position})
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ndweave.mesh.contracts import rank_slice

__all__ = ["DataPosition", "PositionSampler", "rank_slice"]


@dataclass
class DataPosition:
    """How far into the global sample stream training has gone (module docstring). Checkpoint it
    like any other entry: ``save(path, {..., "data": position})``."""

    samples_seen: int = 0
    """Samples of the global stream trained on: the global index of the next sample."""

    def advance(self, num_samples: int) -> None:
        """Count ``num_samples`` more samples as trained on (a global batch, after its step)."""
        if num_samples < 0:
            raise ValueError(f"cannot advance the data position by {num_samples} samples")
        self.samples_seen += int(num_samples)

    def epoch(self, dataset_size: int) -> int:
        """The epoch the next sample belongs to."""
        return self.samples_seen // dataset_size

    def rank_slice(self, global_batch_size: int, dp_rank: int, dp_size: int) -> slice:
        """This rank's part of the next global batch, as global stream positions."""
        part = rank_slice(global_batch_size, dp_rank, dp_size)
        return slice(self.samples_seen + part.start, self.samples_seen + part.stop)

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples_seen = int(state_dict["samples_seen"])


class PositionSampler(torch.utils.data.Sampler[int]):
    """This rank's dataset indices from the current :class:`DataPosition` on, batch after batch:
    global batch ``b`` is stream positions ``[b·G, (b+1)·G)`` and this rank yields its
    :func:`rank_slice` of each, mapped through the epoch's order. Endless (epochs follow each other);
    read the position anew at every ``iter()``, so a loader made before ``load`` resumes correctly.

    Args:
        dataset_size: samples in one epoch.
        position: the shared position (advanced by the training loop).
        global_batch_size: samples per optimizer step over all DP ranks.
        dp_rank, dp_size: this rank's place in the data-parallel group.
        shuffle: each epoch a permutation drawn from ``seed + epoch`` (else in order).
    """

    def __init__(self, dataset_size: int, position: DataPosition, global_batch_size: int, dp_rank: int,
                 dp_size: int, *, shuffle: bool = False, seed: int = 0) -> None:
        rank_slice(global_batch_size, dp_rank, dp_size)  # checks the sizes
        if dataset_size <= 0:
            raise ValueError(f"dataset_size must be positive, got {dataset_size}")
        self.dataset_size, self.position = dataset_size, position
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.shuffle, self.seed = shuffle, seed

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        return torch.randperm(self.dataset_size, generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[int]:
        part = rank_slice(self.global_batch_size, self.dp_rank, self.dp_size)
        batch_start, epoch, order = self.position.samples_seen, None, None
        while True:
            for stream_index in range(batch_start + part.start, batch_start + part.stop):
                if stream_index // self.dataset_size != epoch:
                    epoch = stream_index // self.dataset_size
                    order = self._order(epoch)
                yield int(order[stream_index % self.dataset_size])
            batch_start += self.global_batch_size
