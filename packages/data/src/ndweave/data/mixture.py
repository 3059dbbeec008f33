"""Several datasets drawn from with weights; sample ``k`` of the mixture a pure function of ``k``.

The stream is cut into chunks of ``chunk_size`` samples. Every chunk holds the same number of samples
of each source, ``weight · chunk_size`` rounded so the counts add up (largest remainders), in an
order drawn from ``(seed, chunk)``. Sample ``k`` of the mixture is then sample ``c · n_s + r`` of its
source ``s``, where ``c`` is ``k``'s chunk, ``n_s`` the source's count per chunk and ``r`` how many
samples of ``s`` come before ``k`` in the chunk. Nothing depends on what was read before, so the
mixture adds nothing to the stream's state: the global sample index says where every source stands.
Each source goes through its own epochs at its own pace.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["Mixture"]


class Mixture(torch.utils.data.Dataset):
    """``Mixture([(web, 0.7), (code, 0.3)], seed=0)[k]`` → sample ``k`` of the weighted mixture.

    Args:
        sources: ``(dataset, weight)`` pairs; each dataset maps any sample index ``>= 0`` to a
            sample (a ``PackedDataset``, or another ``Mixture``), all with the same ``block_size``.
        seed: draws each chunk's order.
        chunk_size: samples over which the weights hold exactly; a weight must give a source at least
            one sample per chunk.
    """

    def __init__(self, sources: Sequence[tuple[torch.utils.data.Dataset, float]], *, seed: int = 0,
                 chunk_size: int = 1024) -> None:
        if not sources:
            raise ValueError("a Mixture needs at least one (dataset, weight) source")
        if seed < 0 or chunk_size < 1:
            raise ValueError(f"seed must be >= 0 and chunk_size positive, got seed={seed}, chunk_size={chunk_size}")
        datasets = [d for d, _ in sources]
        weights = np.asarray([float(w) for _, w in sources])
        if (weights <= 0).any() or not np.isfinite(weights).all():
            raise ValueError(f"mixture weights must be positive, got {weights.tolist()}")
        sizes = {getattr(d, "block_size", None) for d in datasets} - {None}
        if len(sizes) > 1:
            raise ValueError(f"the sources of a mixture have different block sizes {sorted(sizes)}: build them alike")
        self.datasets, self.seed, self.chunk_size = datasets, seed, chunk_size
        self.block_size = sizes.pop() if sizes else None
        self.weights = weights / weights.sum()
        exact = self.weights * chunk_size
        counts = np.floor(exact).astype(np.int64)
        counts[np.argsort(counts - exact, kind="stable")[: chunk_size - counts.sum()]] += 1
        if (counts == 0).any():
            raise ValueError(f"weight {self.weights[counts == 0].min():.2g} gives no sample in a chunk of {chunk_size}: "
                             "raise chunk_size")
        self.counts = counts
        """Samples of each source per chunk."""
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None

    def _chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position, its rank among the chunk's samples of that source)."""
        if self._cache is None or self._cache[0] != chunk:
            source = np.random.default_rng([self.seed, chunk]).permutation(np.repeat(np.arange(self.counts.size), self.counts))
            rank = np.empty_like(source)
            for s in range(self.counts.size):
                rank[source == s] = np.arange(self.counts[s])
            self._cache = (chunk, source, rank)
        return self._cache[1], self._cache[2]

    def locate(self, k: int) -> tuple[int, int]:
        """``(source, index in that source)`` of the mixture's sample ``k``."""
        chunk, at = divmod(int(k), self.chunk_size)
        source, rank = self._chunk(chunk)
        s = int(source[at])
        return s, chunk * int(self.counts[s]) + int(rank[at])

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        if k < 0:
            raise IndexError(f"sample {k}: the stream starts at 0")
        s, index = self.locate(k)
        return self.datasets[s][index]
