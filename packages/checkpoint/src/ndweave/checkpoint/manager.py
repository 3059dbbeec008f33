"""``CheckpointManager``: step-numbered checkpoints in one folder, the newest complete one found
again, old ones removed."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ndweave.checkpoint.buffers import StagingBuffers
from ndweave.checkpoint.commit import is_complete
from ndweave.checkpoint.coordination import broadcast, is_distributed
from ndweave.checkpoint.loader import LoadResult, load
from ndweave.checkpoint.saver import DEFAULT_TIMEOUT_S, SaveHandle, start_save
from ndweave.mesh.lifecycle import destroy_side_group, new_side_group

__all__ = ["CheckpointManager"]

_STEP = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    """Checkpoints ``root/step_00000100``, ``root/step_00000200``, ... of one training run.

    Only *complete* checkpoints count (committed by every rank: :func:`~ndweave.checkpoint.save`'s
    marker); a save that crashed leaves a ``.partial`` folder that is ignored, and removed after the
    next successful save. Rank 0 removes all but the newest ``keep_last`` complete checkpoints right
    after each commit (``None`` keeps all)::

        manager = CheckpointManager("ckpt", keep_last=3)
        state = {"model": model, "optimizer": optimizer, "data": position}
        start = (manager.load_latest(state) or 0) + 1      # None on a fresh start
        for step in range(start, num_steps + 1):
            train_step()
            if step % 100 == 0:
                manager.save(step, state)
        manager.close()                                     # the last async save committed, its group gone

    ``with CheckpointManager(...) as manager:`` closes it on leaving the block, as does
    ``ndweave.mesh.shutdown(manager)``.

    Args:
        root: the folder holding the step folders (created on the first save).
        keep_last: how many complete checkpoints to keep.
        async_checkpoint: default for :meth:`save`.
        reuse_buffers: asynchronous saves copy into host buffers kept for the next save
            (:class:`~ndweave.checkpoint.StagingBuffers`): faster copies, for this rank's share of
            the checkpoint held in host memory between saves.
        timeout: seconds the ranks wait for each other while saving (default: ndweave's collective
            timeout, 300 s); the timeout of the group this manager makes, too.
        process_group: the group asynchronous saves plan on, so that their planning runs in the
            background thread (:func:`~ndweave.checkpoint.save`); default: a gloo group of every
            rank made by the first asynchronous save (on every rank, as saves are), used by this
            manager only (tagged ``ndweave:checkpoint-planning``) and destroyed by :meth:`close`.
            Gloo because the planning exchanges small Python objects between host threads; a group
            of the training loop's would race its collectives.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int | None = 3, *, async_checkpoint: bool = False,
                 timeout: float = DEFAULT_TIMEOUT_S, reuse_buffers: bool = False,
                 process_group: dist.ProcessGroup | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None to keep every checkpoint), got {keep_last}")
        self.root, self.keep_last = Path(root), keep_last
        self.async_checkpoint, self.timeout = async_checkpoint, timeout
        self.buffers = StagingBuffers() if reuse_buffers else None
        """The host buffers asynchronous saves reuse (``reuse_buffers=True``), else ``None``."""
        self._process_group = process_group
        self._own_group: dist.ProcessGroup | None = None  # the group made here (destroyed by close())
        self._pending: SaveHandle | None = None  # the last save (saves run one at a time)
        self._closed = False
        self.last_load: LoadResult | None = None
        """What the last :meth:`load_latest` left out (with ``strict=False``)."""

    def path(self, step: int) -> Path:
        """The folder of step ``step``'s checkpoint."""
        if step < 0:
            raise ValueError(f"steps are non-negative, got {step}")
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP.match(p.name))]
        return sorted(step for step, p in found if is_complete(p))

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, or ``None`` if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict[str, Any], *, async_checkpoint: bool | None = None) -> SaveHandle:
        """Save ``state`` as step ``step`` (a collective, see :func:`~ndweave.checkpoint.save`); once it
        is committed rank 0 applies the retention and removes what crashed saves left."""
        if self._closed:
            raise RuntimeError(f"CheckpointManager({str(self.root)!r}) is closed: make a new one to save again")
        asynchronous = self.async_checkpoint if async_checkpoint is None else async_checkpoint
        self._pending = start_save(self.path(step), state, async_checkpoint=asynchronous, timeout=self.timeout,
                                   on_commit=self._clean, buffers=self.buffers,
                                   group=self._planning_group() if asynchronous else None)
        return self._pending

    def close(self) -> None:
        """Finish this manager's pending asynchronous save (committed on every rank, or its
        :class:`~ndweave.checkpoint.CheckpointError` raised here unless ``wait()`` already raised it),
        then destroy the process group the manager made for its saves (a group passed in is the
        caller's). Call it on every rank, as saves are; a second call does nothing, a ``save()``
        after it raises. ``ndweave.mesh.shutdown(manager)`` calls it before the groups go."""
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        try:
            if pending is not None and not pending._waited():
                pending.wait()
        finally:
            group, self._own_group = self._own_group, None
            if group is not None:
                self._process_group = None
                destroy_side_group(group)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _planning_group(self) -> dist.ProcessGroup | None:
        if self._process_group is None and is_distributed() and dist.is_gloo_available():
            self._process_group = self._own_group = new_side_group(
                range(dist.get_world_size()), desc="checkpoint-planning", timeout=self.timeout)
        return self._process_group

    def load_latest(self, state: dict[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest complete checkpoint into ``state`` (a collective: every rank loads the one
        rank 0 found); its step, or ``None`` (nothing loaded) if there is none."""
        step = broadcast(self.latest())
        if step is not None:
            self.last_load = load(self.path(step), state, strict=strict)
        return step

    def _clean(self) -> None:
        """Rank 0, after a commit: drop leftovers of crashed saves and checkpoints beyond ``keep_last``.
        Saves are serialized, so no other save of this run is writing now."""
        for p in self.root.iterdir():  # .step_*.partial-<id> and .step_*.replaced-<id>
            if p.is_dir() and p.name.startswith(".step_"):
                shutil.rmtree(p, ignore_errors=True)
        steps = self.steps()
        if self.keep_last is not None:
            for step in steps[: -self.keep_last]:
                shutil.rmtree(self.path(step), ignore_errors=True)
