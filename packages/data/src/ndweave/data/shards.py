"""Prepared data on disk, read back: token shards as memmaps, a document index, a manifest.

A prepared folder holds ``tokens-NNNNN.bin`` (the token ids of whole documents, back to back, as
``uint16`` or ``uint32``), ``mask-NNNNN.bin`` beside them when some documents are chats (one byte
per token: trained on or not), ``documents.npy`` (``int64``, one row ``(shard, start, length)`` per
document, in the sources' order) and ``manifest.json``, written last: a folder without it is an
interrupted ``prepare`` and is never read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MANIFEST", "Shards"]

MANIFEST = "manifest.json"
_REDO = "delete the folder and run prepare() again"


class Shards:
    """The documents of a prepared folder (``prepare`` returns one). Memmaps open lazily, in each
    process that reads (a ``DataLoader`` worker opens its own rather than receiving a copy).

    ``shards.document(i)`` → the token ids of document ``i``; ``shards.loss_mask(i)`` → its per-token
    mask (``None`` when every token is trained on); ``shards.lengths`` → tokens per document.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise ValueError(f"{self.path} holds no {MANIFEST}: it is not prepared data, or its prepare() was "
                             "interrupted; run prepare() again")
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
            index = np.load(self.path / "documents.npy")
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path}: the manifest or document index cannot be read ({e}); {_REDO}") from None
        self.dtype = np.dtype(self.manifest["dtype"])
        self.vocab_size: int | None = self.manifest["vocab_size"]
        self.eos_id: int | None = self.manifest["eos_id"]
        self.has_loss_mask: bool = self.manifest["loss_mask"]
        shards = self.manifest["shards"]
        if index.ndim != 2 or index.shape != (self.manifest["num_documents"], 3):
            raise ValueError(f"{self.path}/documents.npy has shape {index.shape}, the manifest says "
                             f"{self.manifest['num_documents']} documents; {_REDO}")
        self._shard, self._start, self.lengths = (np.ascontiguousarray(index[:, i]) for i in range(3))
        for number, shard in enumerate(shards):
            self._check_size(shard["tokens"], shard["num_tokens"] * self.dtype.itemsize)
            if self.has_loss_mask:
                self._check_size(shard["mask"], shard["num_tokens"])
            ends = (self._start + self.lengths)[self._shard == number]
            if ends.size and ends.max() > shard["num_tokens"]:
                raise ValueError(f"{self.path}/documents.npy points past the end of {shard['tokens']}; {_REDO}")
        self._tokens: list[np.memmap] | None = None
        self._masks: list[np.memmap] | None = None

    def _check_size(self, name: str, expected: int) -> None:
        file = self.path / name
        size = file.stat().st_size if file.exists() else None
        if size != expected:
            raise ValueError(f"shard {file} holds {'no file' if size is None else f'{size} bytes'} but the index expects "
                             f"{expected} bytes: it is truncated or corrupt; {_REDO}")

    def __getstate__(self) -> dict[str, Any]:
        # memmaps pickle as copies of the whole data: send the path, reopen on the other side
        return {**self.__dict__, "_tokens": None, "_masks": None}

    def _open(self) -> None:
        shards = self.manifest["shards"]
        self._tokens = [self._memmap(s["tokens"], self.dtype, s["num_tokens"]) for s in shards]
        if self.has_loss_mask:
            self._masks = [self._memmap(s["mask"], np.dtype(np.uint8), s["num_tokens"]) for s in shards]

    def _memmap(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        if count == 0:  # np.memmap refuses empty files
            return np.zeros(0, dtype)
        return np.memmap(self.path / name, dtype=dtype, mode="r", shape=(count,))

    @property
    def num_documents(self) -> int:
        return int(self.lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def document(self, i: int) -> np.ndarray:
        """The token ids of document ``i`` (a read-only view)."""
        if self._tokens is None:
            self._open()
        start = self._start[i]
        return self._tokens[self._shard[i]][start:start + self.lengths[i]]

    def loss_mask(self, i: int) -> np.ndarray | None:
        """Per token of document ``i``: 1 where trained on; ``None`` when the data has no masks."""
        if not self.has_loss_mask:
            return None
        if self._masks is None:
            self._open()
        start = self._start[i]
        return self._masks[self._shard[i]][start:start + self.lengths[i]]

    def __repr__(self) -> str:
        return f"Shards({str(self.path)!r}, {self.num_documents} documents, {self.num_tokens} tokens, {self.dtype})"
