"""What every benchmark's process tree needs: spawn ranks, set each one up, time fairly on any
device, and hand its figures to ``run_all.py`` as rows of one table."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["Row", "Timing", "add_common_args", "close", "emit", "init_rank", "interleaved", "measure", "report_and_close", "mlp", "spawn", "sync"]


def spawn(worker: Callable[..., None], world: int, *args: Any) -> Any:
    """Run ``worker(rank, world, port, *args, queue)`` on ``world`` fresh processes; return what the
    ranks put on ``queue`` (the first item). Fresh processes keep one run's memory out of the next."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(world, port, *args, queue), nprocs=world, start_method="spawn")
    return queue.get()


def init_rank(rank: int, world: int, port: int, device_type: str = "cpu", threads: int = 1) -> torch.device:
    """Join the process group with the device's default backend; return this rank's device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    if device_type != "cpu":
        module = torch.get_device_module(device_type)
        device = torch.device(device_type, rank % module.device_count())
        module.set_device(device)
    dist.init_process_group(dist.get_default_backend_for_device(device_type), rank=rank, world_size=world)
    return device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer measures it (a no-op on CPU)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def measure(fn: Callable[[], Any], device: torch.device, steps: int = 1) -> tuple[float, float]:
    """Call ``fn`` ``steps`` times between two barriers; return seconds per call of wall time (barrier
    to barrier, so the slowest rank sets it) and of the busiest rank's process CPU time (all its
    threads: the collectives' and background copies' too). Every rank must call it.

    CPU time is the figure to trust on a shared machine: other jobs stretch a rank's wall time while
    it waits for a core, but not the CPU time it spends."""
    dist.barrier()
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    sync(device)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - t0
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)  # after the clock stopped: not part of the timing
    return wall / steps, cpu.item() / steps


@dataclass(frozen=True)
class Timing:
    """Seconds per step over interleaved rounds."""

    wall: float
    """Wall time, median round."""
    best_wall: float
    """Wall time, best round."""
    cpu: float
    """The busiest rank's CPU time, median round."""


def interleaved(fns: dict[str, Callable[[], Any]], device: torch.device, rounds: int, steps: int) -> dict[str, Timing]:
    """Time every ``fns`` entry ``steps`` calls at a time, taking turns over ``rounds`` rounds, so
    drift in the machine's load hits each alike (see ``measure``)."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(measure(fn, device, steps))
    return {name: Timing(statistics.median(w for w, _ in s), min(w for w, _ in s), statistics.median(c for _, c in s))
            for name, s in samples.items()}


def report_and_close(rank: int, timing: dict[str, Timing], queue: Any) -> None:
    """Hand rank 0's ``timing`` (name -> (wall, best wall, CPU)) to ``spawn``, then leave the group."""
    if rank == 0:
        queue.put({k: (t.wall, t.best_wall, t.cpu) for k, t in timing.items()})
    close()


def close() -> None:
    """Leave the process group, torch's rows and ours alike, with ``ndweave.mesh.shutdown()``: after
    ``destroy_process_group()`` alone, gloo's worker threads could still be releasing a last work as
    the interpreter ended, and about one 4-rank run in six aborted there (SIGABRT), its figures lost."""
    from ndweave.mesh import shutdown

    shutdown()


@dataclass(frozen=True)
class Row:
    """One line of ``run_all.py``'s table: ours against the torch-native way at one world size."""

    component: str
    """Ours, e.g. ``ndweave.ddp``."""
    comparison: str
    """The torch-native side and what is timed, e.g. ``torch DDP step``."""
    world: int
    """Number of ranks."""
    wall_ratio: float
    """Ours / theirs, wall time per step (median round)."""
    cpu_ratio: float
    """Ours / theirs, the busiest rank's CPU time per step (median round)."""
    memory: str = ""
    """A memory figure, ours vs theirs, in words."""
    bound: str = ""
    """The theoretical bound and how close ours comes, where one exists."""
    note: str = ""
    """Anything a reader of the ratio needs (absolute times, caveats)."""


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The flags every benchmark takes (``run_all.py`` passes them through)."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="append the result rows to PATH as JSON lines (what run_all.py reads)")


def emit(rows: list[Row], path: str | None) -> None:
    """Append ``rows`` to ``path`` as JSON lines (nothing without a path)."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(asdict(row)) + "\n" for row in rows)


def mlp(layers: int, width: int, classes: int = 10) -> torch.nn.Module:
    """The plain model the DDP and optimizer benchmarks share, seeded so every rank builds the same."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, classes))
