"""``StagingBuffers``: the host memory an asynchronous save copies into, kept for the next save.

A fresh host tensor costs its page faults on first touch: on a machine where memory is the
bottleneck, copying into new memory takes about three times as long as copying into memory already
touched. A training run saves the same tensors again and again, so the buffers of one save fit the
next; keeping them costs holding this rank's share of the checkpoint in host memory between saves
(DCP's ``cache_staged_state_dict`` makes the same trade).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["StagingBuffers"]


class StagingBuffers:
    """Host buffers reused by the asynchronous saves they are given to (``save(..., buffers=...)``,
    or ``CheckpointManager(..., reuse_buffers=True)``), one per saved chunk; a chunk whose shape or
    dtype changed gets a new one, and buffers a save did not use are dropped after it. Saves are
    serialized (the next one waits for the previous one), so a buffer is never overwritten while
    its file is being written."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def copy(self, index: MetadataIndex, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``, the chunk ``index`` of a save, in this chunk's buffer."""
        key = (index.fqn, tuple(index.offset or ()), tuple(tensor.shape), tensor.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        self._used.add(key)
        return buffer.copy_(tensor.detach())

    def release_unused(self) -> None:
        """Drop the buffers the save that just staged did not use (the state changed)."""
        self._buffers = {k: v for k, v in self._buffers.items() if k in self._used}
        self._used = set()
