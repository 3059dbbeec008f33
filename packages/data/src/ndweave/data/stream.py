"""The training loop's view: this DP rank's part of each global batch, and one small state.

**Resume policy.** Samples are numbered globally (``PackedDataset`` / ``Mixture``: sample ``k`` is a
pure function of ``k``). Global batch ``b`` after a position ``p`` is samples ``[p + b·G, p + (b+1)·G)``
and DP rank ``r`` of ``D`` reads the ``r``-th of ``D`` equal contiguous slices of it (``rank_slice``).
The state is the number of samples consumed, ``{"samples_seen": int}``: the DP size, the micro-batch
count, the number of loader workers and the tensor/pipeline layout are not part of it, so a run
resumed on any mesh reads exactly the global batches the uninterrupted run would have read. The key
is ``DataPosition``'s, so ``ndweave.checkpoint`` saves it like any entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ndweave.mesh.contracts import rank_slice

__all__ = ["StreamSampler", "TokenStream"]


class StreamSampler(torch.utils.data.Sampler[int]):
    """This rank's global sample indices, global batch after global batch, from ``start`` on
    (endless). Feed it to a ``DataLoader`` with ``batch_size = global_batch_size // dp_size``."""

    def __init__(self, start: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.part = rank_slice(global_batch_size, dp_rank, dp_size)
        self.start, self.global_batch_size = start, global_batch_size

    def __iter__(self) -> Iterator[int]:
        batch_start = self.start
        while True:
            yield from range(batch_start + self.part.start, batch_start + self.part.stop)
            batch_start += self.global_batch_size


class TokenStream:
    """Batches of this DP rank's samples, and the state that resumes them on any mesh.

    Args:
        dataset: maps a global sample index to a sample (``PackedDataset``, ``Mixture``).
        global_batch_size: samples per optimizer step over all DP ranks.
        dp_rank, dp_size: this rank's place in the data-parallel group (every rank of a TP or PP
            group passes the same ``dp_rank``).
        num_workers: ``DataLoader`` worker processes behind ``iter(stream)`` (0: in this process);
            they change the speed only, never the batches.
        pin_memory: the ``DataLoader``'s.

    Each batch is a dict of ``(global_batch_size // dp_size, block_size)`` tensors. ``samples_seen``
    moves on by ``global_batch_size`` as each batch is handed out, so a checkpoint taken after the
    step that trained on it resumes at the next one (a loader's prefetching does not count)::

        stream = TokenStream(PackedDataset(shards, 1024, packing="documents"), 64,
                             dp_rank=dp_rank, dp_size=dp_size, num_workers=2)
        for step, batch in zip(range(start, num_steps), stream):
            train_step(batch)
            if step % 1000 == 0:
                save(path, {"model": model, "optimizer": opt, "data": stream})
    """

    def __init__(self, dataset: torch.utils.data.Dataset, global_batch_size: int, *, dp_rank: int = 0,
                 dp_size: int = 1, num_workers: int = 0, pin_memory: bool = False) -> None:
        rank_slice(global_batch_size, dp_rank, dp_size)  # checks the sizes
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.samples_seen = 0
        """Samples of the global stream consumed: the global index of the next batch's first sample."""

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self.global_batch_size // self.dp_size

    def rank_indices(self) -> range:
        """Global indices of this rank's part of the next global batch."""
        part = rank_slice(self.global_batch_size, self.dp_rank, self.dp_size)
        return range(self.samples_seen + part.start, self.samples_seen + part.stop)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's part of the next global batch, read in this process; counts it as consumed."""
        batch = torch.utils.data.default_collate([self.dataset[k] for k in self.rank_indices()])
        self.samples_seen += self.global_batch_size
        return batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Endless batches from ``samples_seen`` on, read by a ``DataLoader`` with ``num_workers``."""
        if self.num_workers == 0:
            while True:
                yield self.next_batch()
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=self.batch_size, num_workers=self.num_workers, pin_memory=self.pin_memory,
            sampler=StreamSampler(self.samples_seen, self.global_batch_size, self.dp_rank, self.dp_size))
        for batch in loader:
            self.samples_seen += self.global_batch_size
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples_seen = int(state_dict["samples_seen"])
