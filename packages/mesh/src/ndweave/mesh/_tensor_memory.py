"""``torch_compat.TensorMemory``: torch's tracker of live tensor bytes, loaded on first use (see
``torch_compat.__getattr__``)."""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MemTracker", "TensorMemory"]


class TensorMemory(MemTracker):
    """Live tensor bytes per device while active (a context manager): ``ndweave.mesh.testing.memory``."""

    def __enter__(self) -> TensorMemory:
        # MemTracker's own __enter__ also starts its module tracker, whose backward hooks
        # (register_multi_grad_hook) fail inside the autograd.grad a pipeline stage runs; the
        # totals need only the dispatch mode and the storage-resize patch, started here
        self._fake_mode_on_entry = None  # eager: ops under DTensor's propagation fake mode are skipped
        self._track_resize()
        self.reset_peak()
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args) -> None:
        self._restore_resize()
        TorchDispatchMode.__exit__(self, *args)

    def current_bytes(self, device: str | torch.device = "cpu") -> int:
        """Bytes of live tensors on ``device`` now."""
        return self._total(self.get_tracker_snapshot("current"), device)

    def peak_bytes(self, device: str | torch.device = "cpu") -> int:
        """The most bytes of live tensors on ``device`` at once since the start (or the last
        :meth:`reset_peak`)."""
        return self._total(self.get_tracker_snapshot("peak"), device)

    def reset_peak(self) -> None:
        """From here on the peak starts at what is live now."""
        self._peak_mem_snap = self.get_tracker_snapshot("current")
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}

    @staticmethod
    def _total(snapshot: dict, device: str | torch.device) -> int:
        return int(snapshot.get(torch.device(device), {}).get("Total", 0))
