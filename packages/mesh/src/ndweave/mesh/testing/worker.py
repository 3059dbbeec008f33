"""The rank side of the harness: a long-lived process that runs one function per task.

Started once per (world size, nodes, device type) by :mod:`ndweave.mesh.testing.pool`; it joins the
process group once, then loops: receive a function reference and arguments, run it, send back the
result or the traceback. Reusing the process is what makes a distributed test cost milliseconds
rather than a torch import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib.util
import io
import os
import resource
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["FunctionRef", "RankWarning", "Reply", "Task", "WorkerConfig", "worker_main", "resolve_function"]


@dataclass(frozen=True)
class FunctionRef:
    """A module-level function, located so a fresh process can import it by file path."""

    module: str
    file: str
    qualname: str


@dataclass(frozen=True)
class Task:
    fn: FunctionRef
    args: tuple
    kwargs: dict
    master_port: int | None = None
    """Where a test that creates the process group itself finds its store: a new port per test, so no
    test reads the keys of the one before (torch's ``env://`` store outlives its group while anything
    holds the group, and a new group on the same port would reuse it)."""


@dataclass(frozen=True)
class Reply:
    """What a rank sends back for each task (and once when it has started)."""

    status: str
    """``"ready"``, ``"ok"`` or ``"err"`` (the parent adds ``"died"`` for a rank that went silent)."""
    payload: Any = None
    """The result, or the traceback."""
    output: str = ""
    """What the rank printed during the task."""
    warnings: tuple = ()
    """The :class:`RankWarning`\\ s it raised."""
    failed_at: float | None = None
    """When it failed (``time.time()``: the ranks share the machine's clock), so the first failure
    is reported first whichever reply arrives first."""
    groups: int = 0
    """Process groups alive on the rank after the task (the pool's own included): each gloo group
    keeps a thread that wakes every few milliseconds, so the pool starts afresh past a bound."""


@dataclass(frozen=True)
class RankWarning:
    """A warning a rank raised during a task, sent to the parent to be raised again there (where
    the test runner's warning filters decide: pytest's ``filterwarnings = error`` holds for ranks too)."""

    message: str
    category: type[Warning]
    filename: str
    lineno: int
    module: str | None
    """Dotted name of the module the warning is attributed to (what ``-W ...:module`` filters match)."""


def _module_of(filename: str) -> str | None:
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return name
    return None


def _rank_warnings(caught: list[warnings.WarningMessage]) -> list[RankWarning]:
    seen, out = set(), []
    for w in caught:
        key = (str(w.message), w.category, w.filename, w.lineno)
        if key not in seen:  # a warning per step becomes one
            seen.add(key)
            out.append(RankWarning(str(w.message), w.category, w.filename, w.lineno, _module_of(w.filename)))
    return out


@dataclass(frozen=True)
class WorkerConfig:
    rank: int
    world_size: int
    num_nodes: int
    port: int
    device_type: str
    init_process_group: bool
    log_path: str
    stack_path: str
    pg_timeout_s: float


def resolve_function(ref: FunctionRef) -> Any:
    """Import ``ref``'s module (by file, under the same name the parent used) and get the function."""
    module = sys.modules.get(ref.module)
    if module is None or os.path.abspath(getattr(module, "__file__", "") or "") != os.path.abspath(ref.file):
        # Test modules import their neighbours (pytest's rootdir-prepend convention), so do the same.
        folder = os.path.dirname(os.path.abspath(ref.file))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        name = ref.module if ref.module != "__main__" else "__ndweave_main__"
        spec = importlib.util.spec_from_file_location(name, ref.file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    # @distributed wraps a test body; the ranks run the body, not the pytest-facing wrapper.
    return getattr(obj, "__ndweave_body__", obj)


def _setup(cfg: WorkerConfig) -> None:
    # C-level output (gloo, c10d) goes to a per-rank log the parent reads back on failure.
    log = os.open(cfg.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    stacks = open(cfg.stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # a rank that dies of a signal (an abort from the C heap, a segfault) leaves its Python stacks in
    # the log the parent reads back: where it died, not only that it did
    faulthandler.enable(file=sys.stderr, all_threads=True)

    per_node = cfg.world_size // cfg.num_nodes
    os.environ.update(
        RANK=str(cfg.rank),
        WORLD_SIZE=str(cfg.world_size),
        LOCAL_RANK=str(cfg.rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(cfg.rank // per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(cfg.port),
    )
    # Each mesh a test builds opens gloo sockets that live as long as the rank: allow many.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import torch

    # Several ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    if cfg.device_type != "cpu":
        torch.get_device_module(cfg.device_type).set_device(cfg.rank % per_node)
    if cfg.init_process_group:
        _init_pg(cfg)


def _init_pg(cfg: WorkerConfig) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        backend=dist.get_default_backend_for_device(cfg.device_type),
        rank=cfg.rank,
        world_size=cfg.world_size,
        timeout=timedelta(seconds=cfg.pg_timeout_s),
    )


def _after_task(cfg: WorkerConfig, failed: bool) -> None:
    """Put back the per-process state a test may have changed, so the next test starts clean."""
    import torch
    import torch.distributed as dist

    from ndweave.mesh import DEVICE_MESH
    from ndweave.mesh.lifecycle import forget_announcement, shutdown

    DEVICE_MESH.reset()
    if cfg.init_process_group and dist.is_initialized() and not failed:
        # the pool's store outlives the test: a failure announced and handled in it must not reach the next
        # (after a failed test the pool is killed, and the announcement is what its peers report meanwhile)
        forget_announcement()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if not cfg.init_process_group and dist.is_initialized():
        # pools that leave group creation to the test tear it down after each one; a rank whose test
        # failed does not wait for the others (the pool stops them as soon as its error is in)
        shutdown(abort=failed)
    elif cfg.init_process_group and not dist.is_initialized():
        raise RuntimeError("the test destroyed the pool's process group (shutdown() or destroy_process_group()): "
                           "give a test that ends the job @distributed(..., init_process_group=False)")


def _announce(error: BaseException) -> None:
    """Tell the other ranks through the store that this one failed, and why (as ``shutdown(abort=True)``
    would): one waiting at an ndweave check or in ``shutdown()`` raises an error naming this rank at
    once, rather than being stopped without a word."""
    import torch.distributed as dist

    from ndweave.mesh.lifecycle import announce_failure

    if dist.is_initialized():
        announce_failure(f"{type(error).__name__}: {error}")


def _live_group_count() -> int:
    import torch.distributed as dist

    from ndweave.mesh.torch_compat import live_groups

    return len(live_groups()) if dist.is_initialized() else 0


def worker_main(cfg: WorkerConfig, conn) -> None:
    try:
        _setup(cfg)
    except BaseException:
        conn.send(Reply("err", traceback.format_exc(), failed_at=time.time()))
        return
    conn.send(Reply("ready"))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            break
        if task.master_port is not None:
            os.environ["MASTER_PORT"] = str(task.master_port)
        out = io.StringIO()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # record everything; the parent's filters decide
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    fn = resolve_function(task.fn)
                    result = fn(*task.args, **task.kwargs)
                reply = Reply("ok", result)
            except BaseException as error:  # noqa: BLE001 - every failure, SystemExit included, goes to the parent
                reply = Reply("err", traceback.format_exc(), failed_at=time.time())
                _announce(error)
        reply = dataclasses.replace(reply, output=out.getvalue(), warnings=tuple(_rank_warnings(caught)))
        try:
            _after_task(cfg, failed=reply.status == "err")
        except BaseException:
            failed = reply.payload + "\n" if reply.status == "err" else ""  # the test's own error first
            reply = dataclasses.replace(reply, status="err", failed_at=reply.failed_at or time.time(),
                                        payload=failed + "cleanup after the test failed:\n" + traceback.format_exc())
        reply = dataclasses.replace(reply, groups=_live_group_count())
        try:
            conn.send(reply)
        except Exception:  # an unpicklable result
            conn.send(Reply("err", "the result could not be sent back:\n" + traceback.format_exc(), reply.output,
                            failed_at=time.time()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # destroying a group while a peer still uses it can crash that peer
        dist.destroy_process_group()
