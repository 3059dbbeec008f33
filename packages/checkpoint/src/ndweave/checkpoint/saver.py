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
    write         this rank's files              (background thread when async, at a lower priority)
    commit        rank 0 writes .metadata + marker, renames; the others wait for it

Only the first three are collectives. They run in the calling thread, except for an asynchronous
save given a process group of its own (``CheckpointManager`` makes one): then the call does only
the local plan and the copy of what may change outside ``step()`` (a superset of what the final
plan keeps: replicated values go to one rank), and the background thread plans on that group,
which no training collective uses, after copying what no plan can drop (what this rank alone
writes), so that with sharded state the next ``step()`` does not wait for the planning. Past the
planning, the thread coordinates through files.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan

from ndweave.checkpoint.buffers import StagingBuffers
from ndweave.checkpoint.commit import SaveCommit
from ndweave.checkpoint.coordination import broadcast, coordinate, is_distributed, rank, world_size
from ndweave.checkpoint.entries import entry_kind, saved_state
from ndweave.checkpoint.errors import CheckpointError
from ndweave.checkpoint.pieces import PieceSavePlanner, written_by_this_rank_alone
from ndweave.checkpoint.staging import StagingGate, optimizers_of, remove_finished_gates, step_storages, storage_key
from ndweave.mesh.lifecycle import DEFAULT_TIMEOUT

__all__ = ["DEFAULT_TIMEOUT_S", "SaveHandle", "save", "start_save"]

#: How long ranks wait for each other to finish writing before giving up (seconds): ndweave's
#: collective timeout (``ndweave.mesh.lifecycle.DEFAULT_TIMEOUT``, 300 s), not torch's 30 minutes.
DEFAULT_TIMEOUT_S = DEFAULT_TIMEOUT.total_seconds()


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
    """

    def __init__(self, path: Path, thread: _SaveThread | None = None, planner: PieceSavePlanner | None = None) -> None:
        self.path, self._thread, self._planner = path, thread, planner
        self._gate = None if thread is None else thread.gate

    @property
    def staged_bytes(self) -> int:
        """Host memory this rank holds for the save until its files are written (0 for a sync
        save); waits until the copy is done."""
        if self._planner is None:
            return 0
        self.wait_staged()
        return self._planner.held

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

    def _waited(self) -> bool:
        """Whether :meth:`wait` returned or raised already (a sync save: always)."""
        return self._thread is None or self._thread.observed

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
         timeout: float = DEFAULT_TIMEOUT_S, buffers: StagingBuffers | None = None,
         process_group: dist.ProcessGroup | None = None) -> SaveHandle:
    """Save ``state`` to the folder ``path`` from every rank (a collective).

    ``state`` maps names to models (``nn.Module``s, or lists of a model's chunks), optimizers
    (ndweave's, or any ``torch.optim`` one: saved by parameter FQN), anything else with
    ``state_dict()``/``load_state_dict()`` (lr schedulers, :class:`DataPosition`), and plain tensors
    or values (the same on every rank: one copy is written)::

        save("ckpt/step_100", {"model": model, "optimizer": optimizer, "step": 100})

    The folder appears only once every rank has finished (written as ``.step_100.partial-<id>`` and
    renamed); a crash leaves any previous checkpoint at ``path`` intact.

    Args:
        async_checkpoint: return before the files are written; a background thread copies what
            this rank writes off the live tensors, then writes the files. Training goes on
            meanwhile: each optimizer of ``state`` waits in its next ``step()`` until the copy is
            done (a step pre-hook), and tensors that can change outside a step (module buffers,
            plain tensors) are copied before returning, as is everything when ``state`` holds no
            optimizer. Changing saved parameters or optimizer state outside ``step()`` right after
            the save needs ``handle.wait_staged()`` first. The next ``save`` in this process waits
            for this one.
        timeout: seconds the ranks wait for each other to finish writing (default: ndweave's
            collective timeout, 300 s; a slow file system may need more).
        buffers: host buffers an async save copies into and keeps for the next save given them
            (:class:`StagingBuffers`: faster copies, for this rank's share of host memory held
            between saves); default: fresh memory, freed once the files are written.
        process_group: the group the save's planning collectives run on (default: the default
            group). With a group of its own (a gloo group of every rank, created once on every rank
            and passed to every save; :class:`CheckpointManager` makes one), an async
            save plans in the background thread too and the call returns after this rank's local
            plan and the copy of its buffers: on the default group the planning (two collectives)
            must stay in the call, since a background collective would race the training loop's.

    Returns:
        a :class:`SaveHandle`; ``handle.wait()`` returns once the checkpoint is committed.
    """
    return start_save(path, state, async_checkpoint=async_checkpoint, timeout=timeout, buffers=buffers,
                      group=process_group)


class _Save:
    """One save's steps (module docstring), shared by the calling and the background thread."""

    def __init__(self, path: Path, state: dict[str, Any], planner: PieceSavePlanner,
                 group: dist.ProcessGroup | None, timeout: float, on_commit: Callable[[], None] | None) -> None:
        self.path, self.state, self.planner, self.group = path, state, planner, group
        self.timeout, self.on_commit = timeout, on_commit
        self.me, self.world = rank(group), world_size(group)
        self.commit: SaveCommit | None = None
        self.writer: FileSystemWriter | None = None
        self.metadata: Any = None  # rank 0's, written at the commit

    def local_plan(self) -> tuple[SavePlan, dict[str, list[str]]]:
        """What this rank holds (no collective)."""
        self.planner.set_up_planner(saved_state(self.state), is_coordinator=self.me == 0)
        return self.planner.create_local_plan(), _group_params(self.planner.state_dict, self.state)

    def plan(self, local: Callable[[], tuple[SavePlan, dict[str, list[str]]]]) -> None:
        """The save id and the global plan (collectives on ``group``); ``local`` gives (or raises
        instead of) this rank's local plan."""
        planner = self.planner
        self.commit = SaveCommit(self.path, broadcast(uuid.uuid4().hex, self.group), self.me, self.world, self.timeout)
        self.writer = writer = FileSystemWriter(self.commit.staging)

        def prepared():
            plan, groups = local()
            writer.set_up_storage_writer(self.me == 0, rank=self.me, use_collectives=True)
            self.commit.prepare()
            return writer.prepare_local_plan(plan), groups

        def global_plan(gathered):
            global_plans, self.metadata = planner.create_global_plan([plan for plan, _ in gathered])
            return [(plan, _joined([groups for _, groups in gathered])) for plan in writer.prepare_global_plan(global_plans)]

        try:
            plan, groups = coordinate(f"planning the save of {self.path}", prepared, global_plan, self.group)
        except CheckpointError:
            if self.me == 0:
                shutil.rmtree(self.commit.staging, ignore_errors=True)  # every rank has left the planning
            raise
        try:
            planner.finish_plan(plan)
            planner.update_values(groups)  # written by whichever rank DCP picked: the same on all
        except Exception as error:
            raise self.failed(error, "preparing to write") from error

    def failed(self, error: BaseException, doing: str) -> CheckpointError:
        """Tell rank 0 this rank failed (it aborts the save); the error to raise here."""
        if self.commit is not None:
            self.commit.report_failed("".join(traceback.format_exception(error)))
        return CheckpointError(f"rank {self.me} failed {doing} {self.path}: {error!r}")

    def write_and_commit(self) -> None:
        try:
            with _without_crc32():
                written = self.writer.write_data(self.planner.plan, self.planner)
            written.wait()
            results = written.value()
        except Exception as error:
            raise self.failed(error, "writing its files of") from error
        self.commit.report_done(results)
        if self.me == 0:
            everyone = self.commit.collect()
            self.commit.commit(lambda: self.writer.finish(self.metadata, everyone))
            if self.on_commit is not None:
                self.on_commit()
        else:
            self.commit.wait_committed()


@contextmanager
def _without_crc32() -> Iterator[None]:
    """Write without ``torch.save``'s CRC32 of every record: computing it took a quarter of a save's
    CPU time here, and nothing checks it (``torch.load``, hence ``dcp.load``, reads records without
    it; a flipped bit loads either way). torch keeps the setting per thread, so training threads
    saving meanwhile are unaffected."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def start_save(path: str | os.PathLike, state: dict[str, Any], *, async_checkpoint: bool, timeout: float,
               on_commit: Callable[[], None] | None = None, buffers: StagingBuffers | None = None,
               group: dist.ProcessGroup | None = None) -> SaveHandle:
    """:func:`save`, with ``on_commit`` run by rank 0 right after the commit (retention)."""
    if group is not None and is_distributed() and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(f"process_group has {dist.get_world_size(group)} ranks, the world {dist.get_world_size()}: "
                         "a checkpoint is saved by every rank; pass a group of all of them "
                         "(dist.new_group(backend='gloo'))")
    _wait_for_previous_saves()
    optimizers = optimizers_of(state) if isinstance(state, dict) else []
    remove_finished_gates(optimizers)
    job = _Save(Path(path), state, PieceSavePlanner(buffers if async_checkpoint else None), group, timeout, on_commit)
    owned = step_storages(optimizers) if async_checkpoint else set()

    def stage_early() -> None:  # buffers and plain values now; what only step() changes may wait
        job.planner.stage(lambda tensor: storage_key(tensor) in owned)

    # With a group of its own an async save plans in the background: here only the local plan (a
    # superset of what this rank will write) and the copy of what may change outside step().
    plan_later = async_checkpoint and (group is not None or not is_distributed())
    if not plan_later:
        job.plan(job.local_plan)
        if not async_checkpoint:
            job.write_and_commit()
            return SaveHandle(job.path)
        try:
            stage_early()
        except Exception as error:
            raise job.failed(error, "preparing to write") from error
        gate = StagingGate(job.path, optimizers) if job.planner.deferred else None
        return _start_thread(job, gate, None)

    local, early_error = None, None
    try:
        local = job.local_plan()
        stage_early()
    except Exception as error:  # sent to every rank by the background planning, raised here too
        early_error = error
    gate = StagingGate(job.path, optimizers) if job.planner.deferred and early_error is None else None
    handle = _start_thread(job, gate, (lambda: local) if early_error is None else _raising(early_error))
    if early_error is not None:  # the thread still plans, to fail the save on every rank: raised here instead
        handle._thread.observed = True
        raise CheckpointError(f"rank {job.me} failed preparing to write {job.path}: {early_error!r}") from early_error
    return handle


#: How much the background thread lowers its scheduling priority once nothing waits for it.
WRITER_NICENESS = 10


def _yield_to_training() -> None:
    """Lower this (background) thread's priority for the rest of the save: once the copy is done
    nothing waits for the writes but ``wait()`` and the next save, and on a host short of cores they
    would otherwise take them from the training step (on the 2-core machine, the optimizer step
    right after the copy shared its core with them). A host with a spare core runs them at full
    speed anyway. Linux only: there a thread has a nice value of its own (elsewhere setpriority
    renices the whole process). The thread ends with the save, so nothing is restored."""
    if not sys.platform.startswith("linux"):
        return
    me = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, me, min(os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICENESS, 19))
    except OSError:  # not permitted here: write at the priority it has
        pass


def _raising(error: BaseException) -> Callable[[], Any]:
    def local() -> Any:
        raise error
    return local


def _copied_before_planning(value: Any, world: int) -> bool:
    """What the background copy takes before the global plan is known: what this rank alone writes
    (the global plan keeps all of it), and single values (an optimizer's step count, replicated on
    every rank: a copy costs nothing, written or not)."""
    alone = world == 1 or written_by_this_rank_alone(value)
    return alone or (isinstance(value, torch.Tensor) and value.numel() <= 1)


def _copy_first(job: _Save, gate: StagingGate | None, local: Callable[[], Any]) -> Callable[[], Any]:
    """Before the planning, which waits for every rank, copy what it cannot drop, and open the gate if
    that was all: the next ``step()`` then waits for the copy only (with sharded parameters and
    optimizer state, all of it). A failed copy fails the planning, hence the save, on every rank.
    Returns what the planning takes as this rank's local plan."""
    if gate is None:
        return local
    try:
        job.planner.stage_deferred(only=lambda value: _copied_before_planning(value, job.world))
    except Exception as error:  # noqa: BLE001 - sent to every rank by the planning
        return _raising(error)
    if not job.planner.deferred:
        gate.finish()
    return local


def _start_thread(job: _Save, gate: StagingGate | None, local: Callable | None) -> SaveHandle:
    """The background half: plan (when ``local`` is given; what this rank alone writes is copied
    first), copy the rest of what :func:`start_save` left live, open the gate, write at a lower
    priority, commit."""

    def run() -> None:
        try:
            if local is not None:
                job.plan(_copy_first(job, gate, local))
            if gate is not None:
                job.planner.stage_deferred()
        except BaseException as error:  # noqa: BLE001 - the gate must open whatever happens
            if gate is not None:
                gate.finish(error)
            if isinstance(error, CheckpointError):
                raise
            raise job.failed(error, "copying the tensors it writes of") from error
        if gate is not None:
            gate.finish()
        _yield_to_training()
        job.write_and_commit()

    thread = _SaveThread(run, job.path, gate)
    try:
        thread.start()
    except BaseException as error:
        job.failed(error, "starting to write")
        if gate is not None:  # no thread will open it: the next step() raises instead of waiting forever
            gate.finish(error)
        raise
    return SaveHandle(job.path, thread, job.planner)
