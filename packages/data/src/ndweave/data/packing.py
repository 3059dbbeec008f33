"""Fixed-size training samples from prepared documents; sample ``k`` a pure function of ``k``.

Every sample is ``block_size + 1`` tokens, read as ``input_ids`` (the first ``block_size``) and
``targets`` (the last ``block_size``), with ``loss_mask``, ``position_ids`` and ``document_ids`` per
input token. Four packings:

- ``"concat"``: the documents back to back (EOS-separated when ``prepare`` appended one), cut into
  windows that overlap by one token (a window's last target is the next one's first input);
  attention runs across documents (``document_ids`` all 0), positions ``0..S-1``. The classic.
- ``"documents"``: the same windows, but each document a segment of its own: ``position_ids``
  restart at every document start (the window's first segment, often the tail of a document, starts
  at 0 too, so positions stay below ``block_size``), the target that crosses into the next document
  is masked, and ``document_ids`` (0, 1, ... within the sample) give :func:`document_mask` its blocks.
- ``"first_fit"``: whole documents, never split, packed first-fit into samples, the rest padded
  (``pad_id``, ``document_ids`` -1, loss masked); for SFT. Segments as under ``"documents"``.
- ``"none"``: one document per sample, padded.

Under the last two, a document longer than ``block_size + 1`` tokens is left out (``truncate=False``)
or cut to ``block_size + 1`` (``truncate=True``); if every document is too long, ``ValueError``.

**Determinism.** Epoch ``e`` is ``samples_per_epoch`` samples; sample ``k`` belongs to epoch
``k // samples_per_epoch``. With ``shuffle``, the epoch's document order and sample order are
permutations drawn from ``(seed, e)`` (numpy's PCG64, the same on every platform); ``"first_fit"``
packs once, from a document order drawn from ``seed``, and shuffles the packed samples each epoch, so
that every epoch has the same number of samples. Sample ``k`` is therefore computed from the shards,
the settings and ``k`` alone: any process, rank or ``DataLoader`` worker computes the same one, and a
resumed run needs nothing but the index of the next sample.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from ndweave.data.shards import Shards

__all__ = ["PACKINGS", "PackedDataset", "Packing"]

Packing = Literal["concat", "documents", "first_fit", "none"]
PACKINGS = ("concat", "documents", "first_fit", "none")


class PackedDataset(torch.utils.data.Dataset):
    """``dataset[k]`` → sample ``k`` of an endless stream (any ``k >= 0``; epochs follow each other),
    a dict of ``block_size``-long tensors: ``input_ids``, ``targets`` (int64), ``loss_mask`` (bool),
    ``position_ids``, ``document_ids`` (int64). Put it in a ``TokenStream``, or a ``DataLoader`` with
    any sampler of global indices.

    Args:
        shards: prepared data (``prepare``'s result, or ``Shards(path)``).
        block_size: tokens per sample (the model's sequence length).
        packing: ``"concat"``, ``"documents"``, ``"first_fit"`` or ``"none"`` (module docstring).
        seed: draws the document and sample orders.
        shuffle: permute documents and samples per epoch (else the sources' order, for evaluation).
        truncate: under ``"first_fit"`` / ``"none"``, cut documents longer than ``block_size + 1``
            tokens instead of leaving them out.
        pad_id: the token padding is written with (never trained on).
        open_samples: under ``"first_fit"``, how many of the latest samples a document may still go
            into (a bound that keeps packing linear in the number of documents).
    """

    def __init__(self, shards: Shards, block_size: int, *, packing: Packing = "concat", seed: int = 0,
                 shuffle: bool = True, truncate: bool = False, pad_id: int = 0, open_samples: int = 128) -> None:
        if packing not in PACKINGS:
            raise ValueError(f"packing={packing!r}: use one of {', '.join(map(repr, PACKINGS))}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy's SeedSequence), got {seed}")
        self.shards, self.block_size, self.packing = shards, block_size, packing
        self.seed, self.shuffle, self.truncate, self.pad_id = seed, shuffle, truncate, pad_id
        self.window = block_size + 1
        self.num_dropped = 0
        """Documents left out for being longer than ``block_size + 1`` tokens (``"first_fit"``, ``"none"``)."""
        lengths = shards.lengths
        if packing in ("concat", "documents"):
            self.samples_per_epoch = int((lengths.sum() - 1) // block_size)
            if self.samples_per_epoch < 1:
                raise ValueError(f"{shards.path} holds {lengths.sum()} tokens, fewer than one sample of block_size + 1 = "
                                 f"{self.window}: use a smaller block_size or more data")
        else:
            fits = lengths <= self.window
            if truncate:
                eligible = np.arange(lengths.size)
            else:
                eligible = np.flatnonzero(fits)
                self.num_dropped = int(lengths.size - eligible.size)
                if eligible.size == 0:
                    raise ValueError(f"{shards.path}: every document is longer than block_size + 1 = {self.window} tokens "
                                     f"(the shortest has {lengths.min()}), so packing={packing!r} has no sample; raise "
                                     "block_size, or pass truncate=True to cut documents")
            self._bins = self._pack(eligible, np.minimum(lengths[eligible], self.window), open_samples)
            self.samples_per_epoch = len(self._bins[1]) - 1
        self._epoch_cache: dict[int, tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]] = {}

    # -- orders --------------------------------------------------------------------------------------
    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *key])

    def _epoch(self, epoch: int) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(document order, cumulative token offsets in it, sample order) of an epoch, cached (a
        DataLoader worker reads mostly one epoch at a time)."""
        if epoch not in self._epoch_cache:
            if len(self._epoch_cache) >= 2:
                self._epoch_cache.pop(next(iter(self._epoch_cache)))
            order = cumulative = None
            if self.packing in ("concat", "documents"):
                n = self.shards.num_documents
                order = self._rng(epoch, 0).permutation(n) if self.shuffle else np.arange(n)
                cumulative = np.concatenate([[0], np.cumsum(self.shards.lengths[order])])
            samples = self._rng(epoch, 1).permutation(self.samples_per_epoch) if self.shuffle else None
            self._epoch_cache[epoch] = (order, cumulative, samples)
        return self._epoch_cache[epoch]

    def _pack(self, documents: np.ndarray, lengths: np.ndarray, open_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples as (document ids back to back, offsets into them): first-fit for ``"first_fit"``,
        one document each for ``"none"``."""
        order = self._rng(1 << 31).permutation(documents.size) if self.shuffle else np.arange(documents.size)
        documents, lengths = documents[order], lengths[order]
        if self.packing == "none":
            return documents, np.arange(documents.size + 1)
        room = np.empty(documents.size, np.int64)  # free tokens per sample (at most one sample per document)
        members: list[list[int]] = []
        for document, length in zip(documents.tolist(), lengths.tolist()):
            first = max(0, len(members) - open_samples)
            fits = np.flatnonzero(room[first:len(members)] >= length)
            if fits.size:
                sample = first + int(fits[0])
            else:
                sample = len(members)
                members.append([])
                room[sample] = self.window
            members[sample].append(document)
            room[sample] -= length
        offsets = np.concatenate([[0], np.cumsum([len(m) for m in members])])
        return np.asarray([d for m in members for d in m], np.int64), offsets

    # -- samples -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Samples in one epoch (indices past it continue into the next epochs)."""
        return self.samples_per_epoch

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        if k < 0:
            raise IndexError(f"sample {k}: the stream starts at 0")
        epoch, j = divmod(int(k), self.samples_per_epoch)
        order, cumulative, samples = self._epoch(epoch)
        if samples is not None:
            j = int(samples[j])
        if self.packing in ("concat", "documents"):
            pieces = self._window(order, cumulative, j)
        else:
            documents, offsets = self._bins
            pieces = [self._document(d, 0, self.window) for d in documents[offsets[j]:offsets[j + 1]].tolist()]
        return self._sample(pieces)

    def _document(self, document: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        mask = self.shards.loss_mask(document)
        return self.shards.document(document)[start:stop], None if mask is None else mask[start:stop]

    def _window(self, order: np.ndarray, cumulative: np.ndarray, j: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        start = j * self.block_size
        stop = start + self.window
        i = int(np.searchsorted(cumulative, start, side="right")) - 1
        pieces = []
        while cumulative[i] < stop:
            offset = cumulative[i]
            pieces.append(self._document(int(order[i]), max(start - offset, 0), min(stop, cumulative[i + 1]) - offset))
            i += 1
        return pieces

    def _sample(self, pieces: list[tuple[np.ndarray, np.ndarray | None]]) -> dict[str, torch.Tensor]:
        window = self.window
        tokens = np.full(window, self.pad_id, np.int64)
        trained = np.zeros(window, bool)
        document = np.full(window, -1, np.int64)
        position = np.zeros(window, np.int64)
        at = 0
        for number, (ids, mask) in enumerate(pieces):
            stop = at + ids.size
            tokens[at:stop] = ids
            trained[at:stop] = True if mask is None else mask.astype(bool)
            document[at:stop] = number
            position[at:stop] = np.arange(ids.size)
            at = stop
        if at < window:  # padding: a segment of its own
            position[at:] = np.arange(window - at)
        # a target is trained on where its token is (assistant tokens under SFT; never padding) ...
        loss_mask = trained[1:].copy()
        if self.packing == "concat":
            document[:] = 0
            position = np.arange(window)
        else:
            # ... and, between segments, never where it is the first token of the next document
            loss_mask &= document[1:] == document[:-1]
        return {
            "input_ids": torch.from_numpy(tokens[:-1].copy()),
            "targets": torch.from_numpy(tokens[1:].copy()),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position[:-1].copy()),
            "document_ids": torch.from_numpy(document[:-1].copy()),
        }
