"""Persistent pools of rank processes, and :func:`run_distributed` on top of them.

One pool per (world size, nodes, device type, who initializes the process group) lives for the whole
test session. A task that fails or times out kills its pool (a rank stuck in a collective cannot be
recovered), and the next task starts a fresh one. The pool cache is the harness's only global state.

When a rank raises, the others are stopped at once, as torchrun stops a job's other workers: their
stacks are dumped (where each one was waiting) and the pool is killed, so a test whose rank 1 fails
while rank 0 waits in a receive fails in about a second, with rank 1's traceback first. A rank that
*dies* leaves the others ``FAILURE_GRACE_S`` to finish: tests kill a rank on purpose to check how the
survivors react.

Idle pools cost nothing: every gloo group keeps a thread that wakes every few milliseconds for as
long as it lives, and a rank that had run a few hundred tests held hundreds of them, spending most
of a core doing nothing, which slowed the test running and every launched job on a 2-core machine
until collectives timed out. So a pool's ranks are stopped (``SIGSTOP``) as soon as a task has
finished, while the test goes on in this process or in another pool, and continued when their next
task comes; and a pool whose ranks hold more than ``MAX_GROUPS`` groups is started afresh before its
next task, which bounds what they poll while they work. (Destroying a test's groups
instead is not safe: DTensor caches sharding decisions keyed on meshes by value, so a later equal
mesh would be answered with the destroyed groups, and in torch 2.13 clearing its C++ cache corrupts
the heap.)
"""

from __future__ import annotations

import atexit
import inspect
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Callable

from ndweave.mesh.testing.worker import FunctionRef, Reply, Task, WorkerConfig, worker_main

__all__ = ["DistributedTestError", "RankFailure", "run_distributed", "shutdown_pools", "DEFAULT_TIMEOUT_S"]

#: Seconds a task may take unless the caller says otherwise (env ``NDWEAVE_TEST_TIMEOUT`` overrides).
DEFAULT_TIMEOUT_S = float(os.environ.get("NDWEAVE_TEST_TIMEOUT", "180"))
#: Once one rank has died, how long the others get to finish (and say how they saw the death).
FAILURE_GRACE_S = 10.0
#: Once one rank has raised, how long the others get to reply (a rank raising the same error a moment
#: later reports its own; one waiting at an ndweave check learns of the failure from the store, where
#: the raising rank announced it, within a second) and to dump their stacks before they are killed.
STOP_AFTER_RAISE_S = 1.5
_START_TIMEOUT_S = 300.0
#: A pool whose ranks hold more process groups than this (each with a polling gloo thread) is
#: started afresh before its next task.
MAX_GROUPS = 48
_START_ATTEMPTS = 3


@dataclass
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    kind: str
    """``"raised"``, ``"died"``, ``"timed out"``, or ``"stopped"`` (still running when another rank
    raised)."""
    detail: str
    """The traceback, or the stack dump of a hung or stopped rank, or the exit code and log of a dead one."""
    output: str = ""
    """What the rank printed during the task."""


class DistributedTestError(AssertionError):
    """One or more ranks failed; ``failures`` holds each one's traceback or stack."""

    def __init__(self, what: str, world_size: int, failures: list[RankFailure]) -> None:
        self.failures = failures
        head = f"{len(failures)} of {world_size} ranks failed in {what}: " + ", ".join(
            f"rank {f.rank} {f.kind}" for f in failures
        )
        parts = [head]
        for f in failures:
            parts.append(f"\n----- rank {f.rank} {f.kind} -----\n{f.detail.rstrip()}")
            if f.output.strip():
                parts.append(f"----- rank {f.rank} output -----\n{f.output.rstrip()[-4000:]}")
        super().__init__("\n".join(parts))


@dataclass
class _Pool:
    world_size: int
    num_nodes: int
    device_type: str
    init_process_group: bool
    procs: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    tmpdir: str = ""
    groups: int = 0
    """The most process groups a rank held after the last task."""
    paused: bool = False

    def start(self) -> None:
        """Start the ranks. The store's port is picked free, then bound by rank 0 a moment later:
        another process (a launched job's gloo sockets) can take it in between, so a start that fails
        on the address alone is tried again on another port."""
        for attempt in range(_START_ATTEMPTS):
            try:
                return self._start()
            except DistributedTestError as error:
                if attempt == _START_ATTEMPTS - 1 or "EADDRINUSE" not in str(error):
                    raise

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.tmpdir = tempfile.mkdtemp(prefix=f"ndweave-pool{self.world_size}-")
        port = _free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            cfg = WorkerConfig(
                rank=rank,
                world_size=self.world_size,
                num_nodes=self.num_nodes,
                port=port,
                device_type=self.device_type,
                init_process_group=self.init_process_group,
                log_path=os.path.join(self.tmpdir, f"rank{rank}.log"),
                stack_path=os.path.join(self.tmpdir, f"rank{rank}.stack"),
                pg_timeout_s=max(DEFAULT_TIMEOUT_S, 60.0),
            )
            proc = ctx.Process(target=worker_main, args=(cfg, child), daemon=True, name=f"ndweave-rank{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        replies = self._collect(_START_TIMEOUT_S, what="starting the ranks")
        bad = [r for r, rep in replies.items() if rep.status != "ready"]
        if bad or len(replies) < self.world_size:
            failures = self._failures(replies)
            self.kill()
            raise DistributedTestError("starting the ranks", self.world_size, failures)

    def run(self, ref: FunctionRef, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        self.resume()
        task = Task(ref, args, kwargs, master_port=None if self.init_process_group else _free_port())
        for conn in self.conns:
            conn.send(task)
        replies = self._collect(timeout, what=ref.qualname)
        if len(replies) == self.world_size and all(rep.status == "ok" for rep in replies.values()):
            for rank in range(self.world_size):
                if replies[rank].output:
                    print(f"[rank {rank}] " + replies[rank].output.rstrip().replace("\n", f"\n[rank {rank}] "))
            _reraise_warnings(replies)
            self.groups = max(rep.groups for rep in replies.values())
            self.pause()  # until its next task: the test goes on in this process, or in another pool
            return [replies[rank].payload for rank in range(self.world_size)]
        failures = self._failures(replies)
        self.kill()
        raise DistributedTestError(ref.qualname, self.world_size, failures)

    def _collect(self, timeout: float, what: str) -> dict[int, Reply]:
        """Replies by rank (in the order they came) until all are in, the deadline passes, one rank
        raised (the others get ``STOP_AFTER_RAISE_S``) or one died (``FAILURE_GRACE_S``)."""
        deadline = time.monotonic() + timeout
        replies: dict[int, Reply] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = wait(list(pending) + [s for s, r in sentinels.items() if r not in replies], timeout=remaining)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        replies[rank] = obj.recv()
                    except (EOFError, OSError):
                        replies[rank] = self._death(rank)
                elif sentinels.get(obj) is not None and sentinels[obj] not in replies:
                    rank = sentinels[obj]
                    # give a last message in the pipe a chance to arrive before calling it dead
                    conn = self.conns[rank]
                    if conn.poll(0.2):
                        continue
                    pending.pop(conn, None)
                    replies[rank] = self._death(rank)
                else:
                    continue
                status = replies[rank].status
                if status not in ("ok", "ready"):
                    grace = FAILURE_GRACE_S if status == "died" else STOP_AFTER_RAISE_S
                    deadline = min(deadline, time.monotonic() + grace)
                    if status == "err":  # the stacks of the others now, while they wait where the failure left them
                        self._request_stacks([r for r in pending.values()])
        return replies

    def _failures(self, replies: dict[int, Reply]) -> list[RankFailure]:
        """Every failed rank: those that raised or died first, in the order they failed, then those
        still running (stopped because another raised, or timed out), with their stacks. Each one after
        the first names the first failure (a rank that raised after a peer died reports gloo's "Connection
        reset by peer": the death is the cause), so every rank's report says what went wrong, and where."""
        failures = []
        # a death first: the parent notices it after the peers' gloo errors it causes ("Connection reset")
        failed = sorted((rep.status != "died", rep.failed_at, rank) for rank, rep in replies.items()
                        if rep.status in ("err", "died"))
        first = ""
        for _, _, rank in failed:
            rep = replies[rank]
            kind = "raised" if rep.status == "err" else "died"
            cause = _cause(kind, rep.payload)
            detail = rep.payload if not first else f"after {first}, this rank {kind}:\n{rep.payload}"
            failures.append(RankFailure(rank, kind, detail, rep.output))
            first = first or f"rank {rank} {cause}"
        running = [r for r in range(self.world_size) if r not in replies]
        kind = "stopped" if any(f.kind == "raised" for f in failures) else "timed out"
        stacks = self._dump_stacks(running) if running else {}
        for rank in running:
            what = (f"stopped after {first}; its stack then" if kind == "stopped" and first
                    else "stack when it was stopped" if kind == "stopped" else "stack at the time out")
            failures.append(RankFailure(rank, kind, f"{what}:\n" + stacks.get(rank, "(none)")))
        return failures

    def _request_stacks(self, ranks: list[int]) -> None:
        for rank in ranks:
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, signal.SIGUSR1)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's Python stacks (faulthandler writes them on SIGUSR1), waiting at most a second."""
        paths = {rank: os.path.join(self.tmpdir, f"rank{rank}.stack") for rank in ranks}
        unwritten = [rank for rank in ranks if not os.path.getsize(paths[rank])]
        self._request_stacks(unwritten)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(not os.path.getsize(paths[r]) for r in unwritten if self.procs[r].is_alive()):
            time.sleep(0.02)
        time.sleep(0.05)  # the dump is written in pieces: let the last one land
        return {rank: _tail(path, 8000) or "(no stack was written)" for rank, path in paths.items()}

    def _death(self, rank: int) -> Reply:
        when = time.time()
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        log = _tail(os.path.join(self.tmpdir, f"rank{rank}.log"), 4000)
        return Reply("died", f"the process exited with code {proc.exitcode}\nits log:\n{log}", failed_at=when)

    def pause(self) -> None:
        """Stop the ranks (``SIGSTOP``) while they wait for a task: their gloo threads stop polling."""
        if not self.paused:
            self._signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False

    def _signal(self, signum: int) -> None:
        for proc in self.procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:  # it ended meanwhile
                    pass

    def kill(self) -> None:
        self.resume()  # SIGKILL ends a stopped rank as well; continued so none is ever left stopped
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def close(self) -> None:
        """Ask the ranks to leave cleanly (barrier, destroy groups); kill any that do not."""
        self.resume()
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10.0)
        self.kill()


def _reraise_warnings(replies: dict[int, Reply]) -> None:
    """Raise the ranks' warnings here, once each, under this process's filters (an ``error`` filter
    turns one into the test's failure, as for a warning raised in the test itself)."""
    seen = set()
    for rank in sorted(replies):
        for w in replies[rank].warnings:
            key = (w.message, w.category, w.filename, w.lineno)
            if key not in seen:
                seen.add(key)
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, module=w.module)


_POOLS: dict[tuple, _Pool] = {}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    num_nodes: int = 1,
    device_type: str = "cpu",
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` real ranks; return each rank's result.

    ``fn`` must be a module-level function (ranks import it by file). The ranks are persistent
    processes with the default process group already initialized (``init_process_group=False``
    leaves that to ``fn`` and tears it down after). ``num_nodes`` simulates a multi-node layout in
    ``LOCAL_RANK``/``GROUP_RANK``. If any rank raises, dies, or is still running after ``timeout``
    seconds, :class:`DistributedTestError` reports every rank's traceback or stack.
    """
    if world_size < 1 or world_size % num_nodes:
        raise ValueError(f"world_size {world_size} must be positive and divisible by num_nodes {num_nodes}")
    ref = function_ref(fn)
    key = (world_size, num_nodes, device_type, init_process_group)
    pool = _POOLS.get(key)
    if pool is not None and pool.procs and pool.groups > MAX_GROUPS:
        pool.close()
    if pool is None or not pool.procs or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.kill()
        pool = _Pool(world_size, num_nodes, device_type, init_process_group)
        if not _POOLS:
            atexit.register(shutdown_pools)  # registering twice is harmless: the second finds nothing
        _POOLS[key] = pool
        pool.start()
    try:
        return pool.run(ref, args, kwargs, DEFAULT_TIMEOUT_S if timeout is None else timeout)
    except BaseException:
        if not pool.procs:
            _POOLS.pop(key, None)
        raise


def function_ref(fn: Callable[..., Any]) -> FunctionRef:
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise TypeError(
            f"{fn.__qualname__} is defined inside a function or is a lambda; ranks import the function "
            "by name, so define it at module level"
        )
    file = inspect.getsourcefile(inspect.unwrap(fn)) or inspect.getfile(fn)
    return FunctionRef(module=fn.__module__, file=os.path.abspath(file), qualname=fn.__qualname__)


def shutdown_pools() -> None:
    """Close every pool (called at exit and at the end of a pytest session)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cause(kind: str, detail: str) -> str:
    """A failure in a few words: ``raised ValueError: bad batch``, ``died (the process exited with code 3)``."""
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    if kind == "died":
        return f"died ({lines[0]})" if lines else "died"
    last = next((line for line in reversed(lines) if not line.startswith(" ")), "")
    return f"raised {last[:300]}" if last else "raised"


def _tail(path: str, chars: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""

