"""Byte-level text data for the GPT job: every byte is a token (vocabulary 256, no tokenizer).

The corpus is ``shakespeare.txt`` beside this module, package data (see ``README.md`` there). It is cut into non-overlapping
windows of ``block_size + 1`` bytes; a sample is one window (inputs: its first ``block_size`` bytes,
targets: the same shifted by one). The last ``VALIDATION_WINDOWS`` windows are held out for the
validation loss; the others form one global stream of training samples, the same at every mesh:
epoch after epoch, a permutation of the windows drawn from ``(seed, epoch)``. A step trains on the
next ``global_batch`` samples of the stream and each data-parallel rank reads only its contiguous
slice of them (``ndweave.checkpoint.DataPosition.rank_slice``). The checkpoint holds the stream
position, so a run resumed at another DP size trains on exactly the batches the uninterrupted run
would have.

``--data`` (your files, a tokenizer, packing, SFT) is :mod:`ndweave_gpt.data.tokens`, on ``ndweave-data``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ndweave.checkpoint import DataPosition

__all__ = ["CORPUS", "DOCUMENT_PACKINGS", "VALIDATION_WINDOWS", "VOCAB_SIZE", "TextData", "bytes_text", "example_batch",
           "keeps_documents_apart"]

CORPUS = Path(__file__).resolve().parent / "shakespeare.txt"
VOCAB_SIZE = 256
VALIDATION_WINDOWS = 64
#: the packings that keep documents apart: the model takes their position ids and document mask
DOCUMENT_PACKINGS = ("documents", "first_fit")


def bytes_text(tokens: list[int]) -> str:
    """The bytes among ``tokens`` as text (a pretrained model's vocabulary may hold more ids)."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def keeps_documents_apart(config: Any) -> bool:
    """Whether the model takes ``--data``'s position ids and document mask: a packing that keeps
    documents apart (``--packing auto`` resolves to documents, or first_fit for chats)."""
    return bool(config.data.data) and config.data.packing in ("auto", *DOCUMENT_PACKINGS)


def example_batch(config: Any, rows: int, device: str | torch.device,
                  cp: int = 1) -> torch.Tensor | dict[str, torch.Tensor]:
    """One micro-batch of ``rows`` samples' inputs as the model takes them (zeros; ``device="meta"``
    allocates nothing): token ids, or a dict of ``input_ids``, ``position_ids`` and the ``(B, 1, S, S)``
    document mask (:func:`keeps_documents_apart`). What the pipeline traces and the estimate prices.
    ``cp`` > 1: a CP rank's share of each sequence, with its (global) position ids and its rows of the
    document mask."""
    size = config.model.block_size
    ids = torch.zeros((rows, size // cp), dtype=torch.long, device=device)
    if not keeps_documents_apart(config):
        return {"input_ids": ids, "position_ids": ids.clone()} if cp > 1 else ids
    mask = torch.ones((rows, 1, size // cp, size), dtype=torch.bool, device=device)
    return {"input_ids": ids, "position_ids": ids.clone(), "attention_mask": mask}


class TextData:
    """The corpus as windows of ``block_size + 1`` bytes, read in a seeded order."""

    def __init__(self, block_size: int, seed: int, path: Path = CORPUS) -> None:
        raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
        windows = (raw.numel() - 1) // (block_size + 1)
        self.num_samples = windows - VALIDATION_WINDOWS
        if self.num_samples < 1:
            raise ValueError(f"{path} is shorter than {VALIDATION_WINDOWS + 1} windows of block_size + 1 = "
                             f"{block_size + 1} bytes")
        everything = raw[: windows * (block_size + 1)].view(windows, block_size + 1)
        self.windows, self.held_out = everything[:self.num_samples], everything[self.num_samples:]
        self.seed = seed

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def samples(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of stream positions ``[start, stop)`` (crossing epochs if need be)."""
        positions = torch.arange(start, stop)
        index = torch.empty_like(positions)
        for epoch in (positions // self.num_samples).unique().tolist():
            here = positions // self.num_samples == epoch
            index[here] = self._order(epoch)[positions[here] % self.num_samples]
        windows = self.windows[index]
        return windows[:, :-1], windows[:, 1:]

    def batch(self, position: DataPosition, global_batch: int, dp_rank: int = 0,
              dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's slice of the next global batch (the position is advanced by the caller,
        after the optimizer step)."""
        part = position.rank_slice(global_batch, dp_rank, dp_size)
        return self.samples(part.start, part.stop)

    #: what ``--sample`` writes after
    prompt: list[int] = list(b"ROMEO:\n")

    def text(self, tokens: list[int]) -> str:
        """``tokens`` as text: :func:`bytes_text`."""
        return bytes_text(tokens)

    def validation(self, count: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's slice of the first ``count`` held-out samples (the same every evaluation)."""
        if count > VALIDATION_WINDOWS:
            raise ValueError(f"a validation batch of {count} samples > the {VALIDATION_WINDOWS} held out")
        per_rank = count // dp_size
        windows = self.held_out[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return windows[:, :-1], windows[:, 1:]
