"""A job's bounds on its meshes: the collective timeout ndweave uses when you give none, side groups
for small checks, and :func:`shutdown`, the one call that ends a job cleanly.

**The default timeout** (:data:`DEFAULT_TIMEOUT`, 300 s). A collective whose peer never comes (a
rank that died, skipped a step, or left the loop) waits for its group's timeout; torch's default is
30 minutes on gloo (10 on NCCL), during which a job looks alive and holds its machines. ndweave gives
every group it creates 300 s unless told otherwise: torchtitan's bound for its initialization and
first step, which is the longest legitimate wait between ranks in a training job (a rank loading or
writing a checkpoint synchronously, the first step's compilation, a slow data loader); steps after
that wait far less, so a job that needs a tighter bound passes its own (the GPT job uses 30 s).

**Side groups** (:func:`new_side_group`). Every group an ndweave package makes for itself (ddp's
per-step check, a checkpoint manager's planning group, a pipeline engine's own group) is made by
:func:`new_side_group`: a bounded timeout (:data:`DEFAULT_TIMEOUT` unless given one), a
``group_desc="ndweave:<what>"`` tag that names it in torch's registry and its error messages, and
only its own ranks taking part. :func:`side_group` is the one made once per purpose and group: a
check that must not queue behind the work in flight on a group runs on a gloo group of the same
ranks, tagged ``"ndweave:<purpose>:<group name>"`` so it is found again, with the group's timeout.
Whoever owns such a group ends it with :func:`destroy_side_group` (its ``close()``).

**Closing** (``shutdown(*closeables)``). What holds groups, hooks or background work (a ``DDP``
wrapper, a ``CheckpointManager``, a ``PipeEngine``) has a ``close()``; :func:`shutdown` closes those
it is given, in that order, before it waits for the others, so a pending asynchronous save is
committed before any group goes.

**Shutdown** (:func:`shutdown`). Ending a job with ``destroy_process_group()`` alone has two faults:

* a rank still in a collective (an extra ``step()``, a rank that left the loop early) leaves the
  others waiting without a name; shutdown's barrier names the ranks that did not come, on every
  rank that did, and a rank that calls ``shutdown(abort=True)`` from its error handler tells the
  others why it is gone;
* on gloo, about one run in six of a 4-rank job aborted at interpreter exit ("terminate called
  without an active exception", SIGABRT, exit code -6) after its last line. The cause, read from a
  core dump of the aborting rank: one of gloo's worker threads (``pt_gloo_runloop``) was destroying a
  finished work (``~AsyncAllreduceWork``), whose tensors are Python objects; releasing them needs the
  GIL (``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire``), the main thread was already in
  ``Py_FinalizeEx``, and CPython ends any other thread that asks for the GIL then
  (``PyThread_exit_thread`` -> ``pthread_exit``) by a forced unwind, which ``std::terminate``\\ s in a
  noexcept destructor. ``destroy_process_group()`` does not stop those threads: they live as long as
  the Python objects holding the group (a DDP wrapper, an optimizer), and a work is released by its
  thread just after it completes, so the last collective before exit (a barrier, a gather of the
  parameters, an un-waited async gather) races with the interpreter's end. Shutdown waits for every
  group's work to finish (a barrier on each gloo group: gloo's barrier waits for the work before it)
  and then until no gloo worker thread is still running (the GIL free meanwhile, so one waiting for it
  finishes releasing its work) before it returns.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ndweave.mesh.torch_compat import default_store, find_group, group_device_types, group_timeout, live_groups

__all__ = ["DEFAULT_TIMEOUT", "ShutdownError", "announce_failure", "as_timedelta", "collective_timeout",
           "destroy_side_group", "failed_ranks", "forget_announcement", "new_side_group", "ranks_in_shutdown",
           "shutdown", "side_group"]

#: The collective timeout of every group ndweave creates when none is given (see the module docstring).
DEFAULT_TIMEOUT = timedelta(seconds=300)

_KEY = "ndweave/shutdown/"
_ARRIVED = "arrived"
_ABORT = "abort: "
# Counters of announcements (any, failures): a rank polling for its peers reads one counter per poll,
# and a rank's own key only once it moved, so the polls cost the store one request each at any scale.
_ANNOUNCED, _FAILED = "ndweave/announced", "ndweave/failed"
# Shutdown polls the gloo worker threads this often, with the GIL free in between, and returns once
# they were idle this many times in a row (or after _SETTLE_LIMIT_S).
_SETTLE_POLL_S, _SETTLE_QUIET, _SETTLE_LIMIT_S = 0.002, 3, 2.0
# Shutdown looks for its peers in the store at most this many seconds apart (sooner at first).
_PEER_POLL_S = 0.25
_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


class ShutdownError(RuntimeError):
    """:func:`shutdown` found ranks missing or failed; the groups are torn down all the same."""

    def __init__(self, message: str, missing: list[int], failed: dict[int, str]) -> None:
        super().__init__(message)
        self.missing = missing
        """Ranks that did not reach ``shutdown()`` in time."""
        self.failed = failed
        """Ranks that called ``shutdown(abort=True)``, with the error they gave."""


def as_timedelta(timeout: timedelta | float | None) -> timedelta | None:
    """``timeout`` as a ``timedelta`` (numbers are seconds); ``None`` stays ``None``."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timedelta(seconds=timeout)


def collective_timeout(timeout: timedelta | float | None) -> timedelta:
    """The timeout a group ndweave creates gets: ``timeout``, or :data:`DEFAULT_TIMEOUT` for ``None``."""
    return as_timedelta(timeout) or DEFAULT_TIMEOUT


def new_side_group(ranks: Sequence[int], *, desc: str, timeout: timedelta | float | None = None,
                   backend: str | None = "gloo") -> dist.ProcessGroup:
    """A new process group over ``ranks`` (global ranks) for one purpose of ndweave's, the way every
    package makes one: ``timeout`` (seconds or a ``timedelta``; ``None``: :data:`DEFAULT_TIMEOUT`,
    never torch's 30 minutes), tagged ``group_desc="ndweave:<desc>"``, made by ``ranks`` alone (the
    other ranks need not call it). ``backend``: gloo by default (small CPU exchanges), or the one a
    purpose needs (``None``: the default group's)::

        group = new_side_group(range(dist.get_world_size()), desc="checkpoint-planning", timeout=300)
        ...
        destroy_side_group(group)    # the owner's close()
    """
    return dist.new_group(sorted(ranks), timeout=collective_timeout(timeout), backend=backend,
                          use_local_synchronization=True, group_desc=f"ndweave:{desc}")


def destroy_side_group(group: dist.ProcessGroup) -> None:
    """Destroy a group :func:`new_side_group` made, on this rank, and keep torch's count of live groups
    where it was with a group of this rank alone: torch names a group its ranks make alone after those
    ranks and that count, so the next group over the same ranks would take the destroyed one's name
    (and its stale rendezvous keys in the store), or a live one's. Local: no collective."""
    dist.destroy_process_group(group)
    new_side_group([dist.get_rank()], desc="destroyed-group-placeholder")


def side_group(group: dist.ProcessGroup, purpose: str) -> dist.ProcessGroup:
    """A gloo group of ``group``'s ranks for ``purpose``, with ``group``'s timeout: made by those ranks
    alone the first time (:func:`new_side_group`), found again after
    (``group_desc="ndweave:<purpose>:<group name>"``)::

        checks = side_group(mesh["DP"].get_group(), "ddp-sync-check")   # small CPU gathers apart from the buckets
    """
    desc = f"{purpose}:{group.group_name}"
    found = find_group(f"ndweave:{desc}")
    if found is not None:
        return found
    return new_side_group(dist.get_process_group_ranks(group), desc=desc, timeout=group_timeout(group))


def ranks_in_shutdown(ranks: list[int]) -> list[int]:
    """Which of ``ranks`` have called :func:`shutdown` (read from the default group's store): after a
    collective timed out, the peers that had left the training loop. ``[]`` when the store is gone."""
    try:
        store = default_store()
        if not store.add(_ANNOUNCED, 0):
            return []
        return [r for r in ranks if store.check([f"{_KEY}{r}"])]
    except (dist.DistError, RuntimeError):
        return []


def failed_ranks(ranks: list[int]) -> dict[int, str]:
    """Which of ``ranks`` announced a failure (:func:`announce_failure`, ``shutdown(abort=True)``), with
    the error each gave, read from the default group's store. ``{}`` when the store is gone."""
    try:
        store = default_store()
        if not store.add(_FAILED, 0):
            return {}
        present = [r for r in ranks if store.check([f"{_KEY}{r}"])]
        states = store.multi_get([f"{_KEY}{r}" for r in present]) if present else []
    except (dist.DistError, RuntimeError):
        return {}
    return {r: s.decode()[len(_ABORT):] for r, s in zip(present, states) if s.decode().startswith(_ABORT)}


def announce_failure(message: str) -> None:
    """Tell the other ranks, through the default group's store, that this rank fails with ``message``
    (what ``shutdown(abort=True)`` says for the error in flight): a peer waiting in :func:`shutdown`
    raises :class:`ShutdownError` naming this rank and ``message`` at once, and ndweave's checks that
    wait for this rank stop waiting. For an error a peer could otherwise only learn of by a timeout
    (a check that found its peers gone). No collective; nothing when there is no process group."""
    if dist.is_available() and dist.is_initialized():
        _announce(_ABORT + message)


def forget_announcement() -> None:
    """Remove what this rank announced (:func:`announce_failure`, :func:`shutdown`) from the store: for
    a process that goes on in the same process group after a failure it handled (the test harness's
    ranks, between tests). No collective."""
    try:
        default_store().delete_key(f"{_KEY}{dist.get_rank()}")
    except (dist.DistError, RuntimeError):
        pass


def shutdown(*closeables: Any, timeout: timedelta | float | None = None, abort: bool = False) -> None:
    """End this rank's part of the job: close ``closeables``, wait until every rank is here, let the work
    in flight finish, destroy every process group, and return once gloo's threads are idle, so the
    process exits 0.

    ``closeables`` (a ``DDP`` wrapper, a ``CheckpointManager``, a ``PipeEngine``: anything with a
    ``close()``) are closed first, in the order given, with or without a process group: a pending
    asynchronous save is committed before the groups go. A ``close()`` that raises does not stop the
    others; this rank then fails as with ``abort=True`` (the others told which close failed, and why)
    and raises :class:`ShutdownError` naming it. With ``abort=True`` the error in flight is the one
    reported, and a failed ``close()`` is warned about.

    A rank missing after ``timeout`` (default: twice the default group's collective timeout, so a
    peer stuck in a collective has time to fail and say why) is named by :class:`ShutdownError` on
    every rank that came, as is a rank that called ``shutdown(abort=True)`` (with its error). Either
    way the groups are torn down first. ``abort=True`` (in an error handler) tells the others this
    rank failed, and why, and tears down without waiting. Without a process group it only closes::

        try:
            train(mesh, model, optimizer)
        except BaseException:
            shutdown(abort=True)          # the others learn why at their own shutdown()
            raise
        shutdown()

        shutdown(manager, model)          # waits for the manager's last async save, unhooks the model
    """
    in_flight = sys.exc_info()[1]
    for closeable in closeables:
        if not callable(getattr(closeable, "close", None)):
            raise TypeError(f"shutdown() closes what it is given, which needs a close() method; got a "
                            f"{type(closeable).__name__}")
    failures = _close_all(closeables)
    if abort:
        for _, message in failures:
            warnings.warn(f"shutdown(abort=True): {message}", RuntimeWarning, stacklevel=2)
    elif failures:
        message, me, torn = "; ".join(text for _, text in failures), 0, ""
        if dist.is_initialized():  # the others learn why at their own shutdown()
            me, torn = dist.get_rank(), ". This rank's process groups are torn down; exit with an error"
            _announce(_ABORT + message)
            _tear_down(abort=True)
        raise ShutdownError(f"shutdown() on rank {me}: {message}{torn}", [], {me: message}) from failures[0][0]
    if not dist.is_initialized():
        return
    if abort:
        error = in_flight
        _announce(_ABORT + (f"{type(error).__name__}: {error}" if error is not None else "shutdown(abort=True)"))
        _tear_down(abort=True)
        return
    wait = as_timedelta(timeout) or 2 * (group_timeout(dist.group.WORLD) or DEFAULT_TIMEOUT)
    _announce(_ARRIVED)
    missing, failed = _wait_for_peers(dist.get_world_size(), wait)
    if missing or failed:
        message = _explain(missing, failed, wait)
        _tear_down(abort=True)
        raise ShutdownError(message, missing, failed)
    try:
        _finish_work_in_flight()
    except RuntimeError as error:  # gloo's timeouts and closed connections are RuntimeErrors
        message = f"shutdown() on rank {dist.get_rank()}: the work in flight did not finish: {error}"
        _tear_down(abort=True)
        raise ShutdownError(message, [], {}) from error
    _tear_down(abort=False)


def _close_all(closeables: Sequence[Any]) -> list[tuple[BaseException, str]]:
    """Close each in order, going on past a failure: each failure's error, and a line naming it."""
    failures = []
    for closeable in closeables:
        try:
            closeable.close()
        except Exception as error:  # noqa: BLE001 - reported by shutdown, after the others are closed
            failures.append((error, f"{type(closeable).__name__}.close() failed: {type(error).__name__}: {error}"))
    return failures


def _announce(state: str) -> None:
    try:
        store = default_store()
        store.set(f"{_KEY}{dist.get_rank()}", state[:2000])
        store.add(_ANNOUNCED, 1)
        if state.startswith(_ABORT):
            store.add(_FAILED, 1)
    except (dist.DistError, RuntimeError):  # the store went with its host: nobody is left to tell
        pass


def _wait_for_peers(world: int, wait: timedelta) -> tuple[list[int], dict[int, str]]:
    """Ranks that did not announce themselves within ``wait``, and those that announced a failure."""
    store, keys = default_store(), [f"{_KEY}{r}" for r in range(world)]
    deadline, pause = time.monotonic() + wait.total_seconds(), 0.002
    others = [r for r in range(world) if r != dist.get_rank()]
    # polled (store.wait() in slices would log a warning per slice): a peer that announced a failure
    # ends the wait at once, for the others may never come
    while time.monotonic() < deadline:
        try:
            if store.check(keys) or failed_ranks(others):
                break
        except (dist.DistError, RuntimeError):
            break  # the store went with its host: who is missing is read below
        time.sleep(pause)
        pause = min(2 * pause, _PEER_POLL_S)
    try:
        present = [r for r in range(world) if store.check([keys[r]])]
        states = dict(zip(present, (v.decode() for v in store.multi_get([keys[r] for r in present]))))
    except (dist.DistError, RuntimeError):  # the store's host (rank 0's node) is gone
        return [r for r in range(world) if r != dist.get_rank()], {}
    missing = [r for r in range(world) if r not in states]
    failed = {r: s[len(_ABORT):] for r, s in states.items() if s.startswith(_ABORT)}
    return missing, failed


def _explain(missing: list[int], failed: dict[int, str], wait: timedelta) -> str:
    parts = []
    if failed:
        parts += [f"rank {r} failed: {reason}" for r, reason in sorted(failed.items())]
    if missing:
        parts.append(
            f"ranks {missing} did not reach shutdown() within {wait}: they are stuck in a collective the others "
            "did not run (an extra step() or forward, a no_sync() block or a loop exit on some ranks only) or "
            "are gone")
    return (f"shutdown() on rank {dist.get_rank()}: " + "; ".join(parts)
            + ". This rank's process groups are torn down; exit with an error")


def _finish_work_in_flight() -> None:
    """Every rank is here, so every collective has been issued everywhere: let them complete."""
    gloo, other = [], []
    for group in live_groups():  # in creation order: the same on every rank
        (gloo if dist.get_backend(group) == "gloo" else other).append(group)
    for group in gloo:
        dist.barrier(group=group)  # gloo's barrier first waits for the work queued before it
    for device_type in {t for g in other for t in group_device_types(g)} - {"cpu"}:
        module = torch.get_device_module(device_type)
        if module.is_available():
            module.synchronize()  # NCCL's work runs on the device's streams


def _tear_down(abort: bool) -> None:
    """Destroy every group (aborting their work first with ``abort``), then wait for gloo's threads."""
    if abort:
        for group in reversed(live_groups()):
            group.abort()  # NCCL: stops kernels waiting for peers that will not come
    dist.destroy_process_group()
    _settle_gloo_threads()


def _settle_gloo_threads() -> None:
    """Return once no gloo worker thread is running (see the module docstring): each poll sleeps with
    the GIL free, so a worker waiting for it to release a finished work gets it."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):  # no /proc (not Linux): give them a moment instead
        time.sleep(0.1)
        return
    quiet, deadline = 0, time.monotonic() + _SETTLE_LIMIT_S
    while quiet < _SETTLE_QUIET and time.monotonic() < deadline:
        time.sleep(_SETTLE_POLL_S)
        quiet = 0 if _gloo_worker_running(tasks) else quiet + 1


def _gloo_worker_running(tasks: str) -> bool:
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"{tasks}/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]  # the field after "(name)"
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state == "R":
            return True
    return False
