"""``save(path, state)``: every rank writes its share of ``state`` through DCP, and the folder is
committed only once every rank has finished (:mod:`ndweave.checkpoint.commit`).

The steps, on every rank::

    save id       rank 0's, broadcast            (names the .partial folder)
    local plan    what this rank holds           (DCP's planner; sharded optimizer state as PieceSets)
    global plan   rank 0 dedups, builds metadata (a gather and a scatter, errors included), and
                  joins the optimizers' param-group FQN lists (pipeline stages hold different ones)
    stage         async only: copy what this rank writes off the live tensors; parameters and
                  optimizer state in the background thread while every optimizer's next step()
                  waits for it (staging.py), the rest (buffers, plain tensors) before returning
    write         this rank's files              (background thread when async)
    commit        rank 0 writes .metadata + marker, renames; the others wait for it

Only the first three are collectives, all in the calling thread; an asynchronous save's thread
coordinates through files, so it never races the training loop's collectives.
"""

from __future__ import annotations

import os
import shutil
import threading
import traceback
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from ndweave.checkpoint.buffers import StagingBuffers
from ndweave.checkpoint.commit import SaveCommit
from ndweave.checkpoint.coordination import broadcast, coordinate, rank, world_size
from ndweave.checkpoint.entries import entry_kind, saved_state
from ndweave.checkpoint.errors import CheckpointError
from ndweave.checkpoint.pieces import PieceSavePlanner
from ndweave.checkpoint.staging import StagingGate, optimizers_of, remove_finished_gates, step_storages, storage_key

__all__ = ["DEFAULT_TIMEOUT_S", "SaveHandle", "save", "start_save"]

#: How long ranks wait for each other to finish writing before giving up (seconds).
DEFAULT_TIMEOUT_S = 1800.0


class _SaveThread(threading.Thread):
    """The background half of an asynchronous save. Not a daemon: the interpreter finishes the
    checkpoint before it exits. Found again through ``threading.enumerate()`` by the next save,
    which waits for it (no registry of our own)."""

    def __init__(self, target: Callable[[], None], path: Path, gate: StagingGate | None) -> None:
        super().__init__(name=f"ndweave-checkpoint-save {path}", daemon=False)
        self._work, self.path, self.gate = target, path, gate
        self.error: BaseException | None = None
        self.observed = False

    def run(self) -> None:
        try:
            self._work()
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            self.error = error


class SaveHandle:
    """A save in progress (``async_checkpoint=True``) or done. ``wait()`` blocks until the checkpoint
    is committed on every rank and returns its path, or raises the save's :class:`CheckpointError`;
    ``wait_staged()`` until the save no longer reads the live tensors.

    Attributes:
        path: the checkpoint folder.
        staged_bytes: host memory this rank holds for the save until its files are written.
    """

    def __init__(self, path: Path, thread: _SaveThread | None = None, staged_bytes: int = 0) -> None:
        self.path, self._thread, self.staged_bytes = path, thread, staged_bytes
        self._gate = None if thread is None else thread.gate

    def wait_staged(self) -> None:
        """Block until this rank's copy of the tensors it writes is done (``step()`` of every
        optimizer of the state waits for it on its own); raises :class:`CheckpointError` if the
        copy failed. Call it before changing saved parameters or optimizer state outside an
        optimizer's ``step()`` (an EMA update, ``load_state_dict``) right after an async save."""
        if self._gate is not None:
            self._gate.wait()

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
            self._thread.observed = True
            if self._gate is not None:
                self._gate.remove()
            if self._thread.error is not None:
                raise self._thread.error
        return self.path


def _wait_for_previous_saves() -> None:
    for thread in threading.enumerate():
        if isinstance(thread, _SaveThread) and thread is not threading.current_thread():
            thread.join()
            if thread.error is not None and not thread.observed and not (thread.gate and thread.gate.reported):
                thread.observed = True
                warnings.warn(f"the asynchronous save of {thread.path} failed and was never waited on: "
                              f"{thread.error}", RuntimeWarning, stacklevel=3)


def _group_params(flat: dict[str, Any], state: dict[str, Any]) -> dict[str, list[str]]:
    """This rank's FQN list of every optimizer param group, by flat key (``optimizer.param_groups.0.params``)."""
    keys = tuple(f"{k}.param_groups." for k, v in state.items() if entry_kind(v) == "optimizers")
    return {name: value for name, value in flat.items() if name.startswith(keys) and name.endswith(".params")}


def _joined(everyone: list[dict[str, list[str]]]) -> dict[str, list[str]]:
    """Every rank's lists joined, in rank order without repeats: pipeline stages each hold their own
    parameters, and the checkpoint's param groups list all of them (DCP would keep one rank's)."""
    joined: dict[str, dict[str, None]] = {}
    for groups in everyone:
        for name, fqns in groups.items():
            joined.setdefault(name, {}).update(dict.fromkeys(fqns))
    return {name: list(fqns) for name, fqns in joined.items()}


def save(path: str | os.PathLike, state: dict[str, Any], *, async_checkpoint: bool = False,
         timeout: float = DEFAULT_TIMEOUT_S, buffers: StagingBuffers | None = None) -> SaveHandle:
    """Save ``state`` to the folder ``path`` from every rank (a collective).

    ``state`` maps names to models (``nn.Module``s, or lists of a model's chunks), optimizers
    (ndweave's, or any ``torch.optim`` one: saved by parameter FQN), anything else with
    ``state_dict()``/``load_state_dict()`` (lr schedulers, :class:`DataPosition`), and plain tensors
    or values (the same on every rank: one copy is written)::

        save("ckpt/step_100", {"model": model, "optimizer": optimizer, "step": 100})

    The folder appears only once every rank has finished (written as ``.step_100.partial-<id>`` and
    renamed); a crash leaves any previous checkpoint at ``path`` intact.

    Args:
        async_checkpoint: return right after planning; a background thread copies what this rank
            writes off the live tensors, then writes the files. Training goes on meanwhile: each
            optimizer of ``state`` waits in its next ``step()`` until the copy is done (a step
            pre-hook), and tensors that can change outside a step (module buffers, plain tensors)
            are copied before returning, as is everything when ``state`` holds no optimizer.
            Changing saved parameters or optimizer state outside ``step()`` right after the save
            needs ``handle.wait_staged()`` first. The next ``save`` in this process waits for this
            one.
        timeout: seconds the ranks wait for each other to finish writing.
        buffers: host buffers an async save copies into and keeps for the next save given them
            (:class:`StagingBuffers`: faster copies, for this rank's share of host memory held
            between saves); default: fresh memory, freed once the files are written.

    Returns:
        a :class:`SaveHandle`; ``handle.wait()`` returns once the checkpoint is committed.
    """
    return start_save(path, state, async_checkpoint=async_checkpoint, timeout=timeout, buffers=buffers)


def start_save(path: str | os.PathLike, state: dict[str, Any], *, async_checkpoint: bool, timeout: float,
               on_commit: Callable[[], None] | None = None, buffers: StagingBuffers | None = None) -> SaveHandle:
    """:func:`save`, with ``on_commit`` run by rank 0 right after the commit (retention)."""
    _wait_for_previous_saves()
    optimizers = optimizers_of(state) if isinstance(state, dict) else []
    remove_finished_gates(optimizers)
    path = Path(path)
    me, world = rank(), world_size()
    commit = SaveCommit(path, broadcast(uuid.uuid4().hex), me, world, timeout)
    planner = PieceSavePlanner(buffers if async_checkpoint else None)
    writer = FileSystemWriter(commit.staging)

    def local_plan():
        planner.set_up_planner(saved_state(state), storage_meta=writer.storage_meta(), is_coordinator=me == 0)
        writer.set_up_storage_writer(me == 0, rank=me, use_collectives=True)
        commit.prepare()
        return writer.prepare_local_plan(planner.create_local_plan()), _group_params(planner.state_dict, state)

    def global_plan(gathered):
        global_plans, metadata = planner.create_global_plan([plan for plan, _ in gathered])
        mine["metadata"] = metadata  # rank 0 writes it at the commit
        return [(plan, _joined([groups for _, groups in gathered])) for plan in writer.prepare_global_plan(global_plans)]

    mine: dict[str, Any] = {}
    try:
        plan, groups = coordinate(f"planning the save of {path}", local_plan, global_plan)
        planner.state_dict.update(groups)  # written by whichever rank DCP picked: the same on all
    except CheckpointError:
        if me == 0:
            shutil.rmtree(commit.staging, ignore_errors=True)  # every rank has left the planning
        raise
    staged = 0
    try:
        final_plan = planner.finish_plan(plan)
        if async_checkpoint:
            owned = step_storages(optimizers)  # written only by step(): copied in the background
            staged = planner.stage(lambda tensor: storage_key(tensor) in owned)
    except Exception as error:
        commit.report_failed("".join(traceback.format_exception(error)))
        raise CheckpointError(f"rank {me} failed preparing to write {path}") from error

    def write_and_commit() -> None:
        try:
            written = writer.write_data(final_plan, planner)
            written.wait()
            results = written.value()
        except Exception as error:
            commit.report_failed("".join(traceback.format_exception(error)))
            raise CheckpointError(f"rank {me} failed writing its files of {path}: {error!r}") from error
        commit.report_done(results)
        if me == 0:
            everyone = commit.collect()
            commit.commit(lambda: writer.finish(mine["metadata"], everyone))
            if on_commit is not None:
                on_commit()
        else:
            commit.wait_committed()

    if not async_checkpoint:
        write_and_commit()
        return SaveHandle(path)
    gate = StagingGate(path, optimizers) if planner.deferred else None

    def stage_write_and_commit() -> None:
        if gate is not None:
            failure = None
            try:
                planner.stage_deferred()
            except BaseException as error:  # noqa: BLE001 - the gate must open whatever happens
                failure = error
                commit.report_failed("".join(traceback.format_exception(error)))
                raise CheckpointError(f"rank {me} failed copying the tensors it writes of {path}: {error!r}") from error
            finally:
                gate.finish(failure)
        write_and_commit()

    thread = _SaveThread(stage_write_and_commit, path, gate)
    try:
        thread.start()
    except BaseException as error:
        commit.report_failed("".join(traceback.format_exception(error)))
        if gate is not None:  # no thread will open it: the next step() raises instead of waiting forever
            gate.finish(error)
        raise
    return SaveHandle(path, thread, staged)
