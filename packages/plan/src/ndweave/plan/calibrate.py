"""How fast this machine does what a training step asks of it, measured once and kept.

A step-time estimate needs two things: what the step asks (matmul FLOPs, bytes of elementwise work,
how many ops it dispatches, the bytes of each collective) and how fast this machine answers each.
:class:`~ndweave.plan.work.WorkCounter` counts the first while a program runs (on meta, nothing computed); :func:`calibrate`
measures the second in a few seconds and saves it, so every later estimate on the machine reuses it::

    machine = calibrate("cpu")                      # measured once (a few seconds), then read from the cache
    with WorkCounter() as counter:
        loss_fn(model(x), y).backward()            # on meta: counted, not computed
    work = counter.work["all"]
    machine.compute_seconds(work.forward, torch.float32) + machine.compute_seconds(work.backward, torch.float32)

What is measured (:class:`Machine`'s fields say how), each the fastest of a few runs (other jobs
on a shared machine only ever slow a run down):

* matmul throughput, per dtype: ``torch.mm`` of square matrices at a few sizes, the best rate;
* memory bandwidth: a large elementwise add (two reads and a write per element);
* the host's time per op: a small model's forward and backward, over the ops it dispatched (at the
  sizes of small models, on CPU, this rather than FLOPs is most of a step), and the extra time per
  op of the same model made tensor parallel (DTensor), on one rank of a fake world;
* link latency and bandwidth between two ranks of the device type: a tiny and a 4 MiB
  ``all_reduce`` between two processes (gloo on CPU, NCCL on CUDA).

The cache is a JSON file (``~/.cache/ndweave/machine.json`` unless ``path=``), one entry per device
name; ``calibrate(refresh=True)`` measures again. Timings on a machine shared with other jobs move:
estimates built on them rank layouts, they do not promise milliseconds.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ndweave.plan.work import Work, WorkCounter

__all__ = ["CACHE_PATH", "Machine", "calibrate", "collective_seconds"]

#: Where :func:`calibrate` keeps its measurements unless given a ``path``.
CACHE_PATH = Path.home() / ".cache" / "ndweave" / "machine.json"

def collective_seconds(kind: str, nbytes: float, group_size: int, bandwidth: float, latency: float) -> float:
    """Seconds of one collective over ``group_size`` ranks on links of ``bandwidth`` bytes/s and
    ``latency`` s per message, ``nbytes`` the whole buffer (the gathered output, the reduced input),
    by the algorithms MPI and NCCL / gloo use (Thakur, Rabenseifner & Gropp, *Optimization of
    collective communication operations in MPICH*, 2005), ``n`` ranks, ``log`` rounded up:

    * ``all_reduce``: reduce-scatter then all-gather by recursive halving and doubling,
      ``2 log2(n) * latency + 2 (n-1)/n * bytes / bw``;
    * ``all_gather``, ``reduce_scatter``, ``all_to_all``: a ring, ``(n-1) * latency + (n-1)/n * bytes / bw``;
    * ``broadcast``: a binomial tree, ``log2(n) * (latency + bytes / bw)``;
    * ``send`` (point to point): ``latency + bytes / bw``.

    One rank (``n = 1``): nothing moves, 0."""
    n = group_size
    if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send"):
        raise ValueError(f"collective_seconds: unknown collective {kind!r}; use all_reduce, all_gather, "
                         "reduce_scatter, all_to_all, broadcast or send")
    if n <= 1:
        return 0.0
    rounds = math.ceil(math.log2(n))
    if kind == "all_reduce":
        return 2 * rounds * latency + 2 * (n - 1) / n * nbytes / bandwidth
    if kind == "broadcast":
        return rounds * (latency + nbytes / bandwidth)
    if kind == "send":
        return latency + nbytes / bandwidth
    return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


@dataclass(frozen=True)
class Machine:
    """One device of a machine, measured (see :func:`calibrate`); its methods turn counted work into
    seconds. All rates are of one rank (on CPU: one thread, as torchrun's ``OMP_NUM_THREADS=1`` and
    the test harness run each rank)."""

    device_type: str
    """``"cpu"`` or ``"cuda"``."""
    device_name: str
    """What the cache is keyed by: the CPU model, or ``torch.cuda.get_device_name()``."""
    matmul_flops: Mapping[str, float]
    """FLOP/s of ``torch.mm`` per dtype name (``"float32"``, ``"bfloat16"``, ...): the best of a few
    square sizes (a matmul's FLOPs count ``2 m n k``, as torch's flop counter counts them)."""
    memory_bandwidth: float
    """Bytes/s of elementwise work: a 16 MiB ``torch.add`` (bytes read plus bytes written) over its time."""
    op_overhead_s: float
    """Host seconds per op dispatched in a model's forward and backward (Python, dispatcher, autograd
    bookkeeping, kernel launch): a small model's step time (4 x LayerNorm, Linear, GELU, Linear at
    width 32) over its op count."""
    dtensor_op_overhead_s: float
    """Extra host seconds per op of a tensor-parallel program (DTensor's sharding propagation,
    wrapping and redistribution bookkeeping, per local op it dispatches): the same model made tensor
    parallel (sequence-parallel norms, column- then row-parallel linears) on one rank of a fake world
    of two, less its ops at ``op_overhead_s``, over its ops."""
    link_bandwidth: float
    """Bytes/s between two ranks of this device type (gloo over loopback on CPU, NCCL between two
    GPUs): a 4 MiB ``all_reduce`` between two processes, ``2 * latency + bytes / bandwidth``."""
    link_latency_s: float
    """Seconds per message between two ranks: half an 8-byte ``all_reduce`` between two processes."""
    concurrent_ranks: int
    """Ranks that compute at full speed at once: CPU cores this process may run on (one thread per
    rank; more ranks than cores share them), or the GPUs on the host."""
    torch_version: str = ""
    """The torch that was measured (informational)."""
    measured_at: str = ""
    """When (informational: ``YYYY-MM-DD HH:MM:SS``, local time)."""
    host_link_bandwidth: float | None = None
    """Bytes/s between two ranks of one host where that link is faster than :attr:`link_bandwidth`
    (NVLink between a node's GPUs, ``link_bandwidth`` then being the network's); ``None``: the same
    link (what :func:`calibrate` measures: its two processes share a host)."""
    host_link_latency_s: float | None = None
    """Seconds per message on that link; ``None``: :attr:`link_latency_s`."""

    def matmul_seconds(self, flops: float, dtype: torch.dtype | str) -> float:
        name = _dtype_name(dtype)
        if name not in self.matmul_flops:
            raise KeyError(f"Machine: no matmul rate for {name} on {self.device_name} (measured: "
                           f"{sorted(self.matmul_flops)}); calibrate(..., dtypes=[torch.{name}]) measures it")
        return flops / self.matmul_flops[name]

    def elementwise_seconds(self, nbytes: float) -> float:
        return nbytes / self.memory_bandwidth

    def collective_seconds(self, kind: str, nbytes: float, group_size: int, *, within_host: bool = False) -> float:
        """:func:`collective_seconds` on this machine's links: the host's own where the group lies
        within one host (:meth:`within_host`), else the network's."""
        if within_host:
            return collective_seconds(kind, nbytes, group_size, self.host_link_bandwidth or self.link_bandwidth,
                                      self.host_link_latency_s or self.link_latency_s)
        return collective_seconds(kind, nbytes, group_size, self.link_bandwidth, self.link_latency_s)

    def within_host(self, sizes: Mapping[str, int]) -> frozenset[str]:
        """The dims of a mesh of ``sizes`` (outermost first, ranks numbered host by host as torchrun
        numbers them) whose groups lie within one host of :attr:`concurrent_ranks` ranks: a dim is,
        when it and every dim inside it span a number of ranks that divides a host's.

            Machine(..., concurrent_ranks=8).within_host({"PP": 4, "DP": 2, "TP": 8})  # {"TP"}
            Machine(..., concurrent_ranks=8).within_host({"PP": 4, "DP": 2, "TP": 4})  # {"DP", "TP"}
        """
        inside, span = set(), 1
        for dim in reversed(list(sizes)):
            span *= sizes[dim]
            if self.concurrent_ranks % span:
                break
            inside.add(dim)
        return frozenset(inside)

    def compute_seconds(self, work: Work, dtype: torch.dtype | str, *, tensor_parallel: bool = False) -> float:
        """The host and device time of ``work`` on one rank, collectives left out: its matmul FLOPs at
        ``dtype``'s rate plus its elementwise bytes over the memory bandwidth (each op bound by one or
        the other: small ops pay both), and the overhead of each op it dispatched; ``tensor_parallel``:
        its ops run on DTensors, each also paying :attr:`dtensor_op_overhead_s`. On CPU the host
        computes, so the two add up; an accelerator runs the kernels the host launched ahead of it
        (asynchronously), so the slower of the two is the time."""
        per_op = self.op_overhead_s + (self.dtensor_op_overhead_s if tensor_parallel else 0.0)
        device, host = self.matmul_seconds(work.flops, dtype) + self.elementwise_seconds(work.bytes), work.ops * per_op
        return device + host if self.device_type == "cpu" else max(device, host)

    def communication_seconds(self, work: Work, group_sizes: Mapping[str, int],
                              within_host: Collection[str] = ()) -> float:
        """The collectives of ``work``, each over its group (``group_sizes``: group name -> ranks; a
        group not named is an error, not a guess); those of the groups named in ``within_host`` over
        the host's link."""
        total = 0.0
        for kind, nbytes, group in work.collectives:
            if group not in group_sizes:
                raise KeyError(f"Machine.communication_seconds: a {kind} ran over group {group!r}, whose size "
                               f"was not given (given: {sorted(group_sizes)})")
            total += self.collective_seconds(kind, nbytes, group_sizes[group], within_host=group in within_host)
        return total

    def to_json(self) -> dict:
        return {**asdict(self), "matmul_flops": dict(self.matmul_flops)}

    @classmethod
    def from_json(cls, data: Mapping) -> Machine:
        return cls(**{**data, "matmul_flops": dict(data["matmul_flops"])})


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- calibrate


def calibrate(device_type: str = "cpu", *, dtypes: list[torch.dtype] | None = None,
              path: str | os.PathLike | None = None, refresh: bool = False) -> Machine:
    """This machine's :class:`Machine` for ``device_type``: read from the cache (``path``, else
    :data:`CACHE_PATH`) when it holds this device and every dtype asked for, else measured (a few
    seconds) and saved there (entries of other devices kept; missing dtypes measured and added).
    ``refresh=True`` measures everything again. ``dtypes``: the matmul dtypes to rate (default:
    float32 on CPU; float32 and bfloat16 on CUDA). Example::

        machine = calibrate("cpu", path="machine.json")
        machine.matmul_flops["float32"], machine.link_bandwidth, machine.op_overhead_s
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("calibrate('cuda'): no CUDA device is available here")
    wanted = [_dtype_name(d) for d in (dtypes or ([torch.float32] if device_type == "cpu"
                                                  else [torch.float32, torch.bfloat16]))]
    file = Path(path) if path is not None else CACHE_PATH
    name = _device_name(device_type)
    key = f"{device_type}: {name}"
    saved = _read(file)
    machine = None if refresh else _entry(saved, key)
    if machine is not None:
        missing = [d for d in wanted if d not in machine.matmul_flops]
        if not missing:
            return machine
        with _one_thread(device_type):
            rates = {**machine.matmul_flops, **_matmul_rates(device_type, missing)}
        machine = Machine.from_json({**machine.to_json(), "matmul_flops": rates})
    else:
        machine = _measure(device_type, name, wanted)
    saved[key] = machine.to_json()
    _write(file, saved)
    return machine


def _measure(device_type: str, name: str, dtypes: list[str]) -> Machine:
    with _one_thread(device_type):
        rates = _matmul_rates(device_type, dtypes)
        bandwidth = _memory_bandwidth(device_type)
        overhead = _op_overhead(device_type)
    link_bandwidth, latency, dtensor_overhead = _two_ranks(device_type, overhead)
    concurrent = len(os.sched_getaffinity(0)) if device_type == "cpu" else torch.cuda.device_count()
    return Machine(device_type, name, rates, bandwidth, overhead, dtensor_overhead, link_bandwidth, latency,
                   concurrent, torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S"))


def _entry(saved: dict, key: str) -> Machine | None:
    """The saved measurement of ``key``, or ``None`` (none, or written by another version of this
    module: measured again)."""
    try:
        return Machine.from_json(saved[key])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _device_name(device_type: str) -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _read(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return {}


def _write(file: Path, entries: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f".{file.name}.{os.getpid()}")
    partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
    partial.replace(file)  # whole or not at all: a reader never sees half a file


class _one_thread:
    """CPU rates are one rank's: one thread, as the job's ranks run (restored after)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        if self.device_type == "cpu":
            torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.threads)


def _timed(fn: Callable[[], object], device_type: str, budget_s: float, runs: int | None = None) -> float:
    """The fastest of as many runs of ``fn()`` as fit in ``budget_s`` (at least 3), after one; exactly
    ``runs`` where given (collectives: every rank must run as many). The fastest: other work on a
    shared machine only ever slows a run down, so it is the closest to what the machine does."""
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    fn()
    sync()
    times, spent = [], 0.0
    while len(times) < (runs or 3) or (runs is None and spent < budget_s):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        spent += times[-1]
        if len(times) >= 200:
            break
    return min(times)


def _matmul_rates(device_type: str, dtypes: list[str]) -> dict[str, float]:
    sizes = (128, 256, 512) if device_type == "cpu" else (2048, 4096, 8192)
    rates = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        best = 0.0
        for n in sizes:
            a = torch.randn(n, n, device=device_type).to(dtype)
            b = torch.randn(n, n, device=device_type).to(dtype)
            best = max(best, 2 * n**3 / _timed(lambda: torch.mm(a, b), device_type, 0.15))
        rates[name] = best
    return rates


def _memory_bandwidth(device_type: str) -> float:
    n = 2**22 if device_type == "cpu" else 2**27
    a, b = torch.ones(n, device=device_type), torch.ones(n, device=device_type)
    out = torch.empty_like(a)
    return 3 * a.numel() * a.element_size() / _timed(lambda: torch.add(a, b, out=out), device_type, 0.2)


def _probe_model(device_type: str) -> torch.nn.Module:
    """A small transformer-like stack: what a step of a small model dispatches."""
    from torch import nn

    width = 32
    layers = [m for _ in range(4) for m in (nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                             nn.Linear(4 * width, width))]
    return nn.Sequential(*layers).to(device_type)


def _op_overhead(device_type: str) -> float:
    seconds, work = _timed_step(_probe_model(device_type), torch.randn(4, 8, 32, device=device_type), device_type)
    return max(seconds - work.flops / 1e12, 0.0) / max(work.ops, 1)  # the FLOPs of these sizes are nothing


def _timed_step(model: torch.nn.Module, x: torch.Tensor, device_type: str) -> tuple[float, Work]:
    """The fastest forward and backward of ``model`` on ``x`` (:func:`_timed`), and its work."""
    def step():
        model(x).sum().backward()

    seconds = _timed(step, device_type, 0.4)
    with WorkCounter() as counter:
        step()
    return seconds, counter.work["all"].total


def _two_ranks(device_type: str, op_overhead: float) -> tuple[float, float, float]:
    """(link bandwidth, latency, DTensor op overhead), measured by two processes (forked on CPU, which
    starts in a fraction of a second; spawned for CUDA) over gloo / NCCL; then rank 0 alone times a
    tensor-parallel program over a fake process group (its collectives return at once)."""
    context = mp.get_context("fork" if device_type == "cpu" else "spawn")
    port = _free_port()
    queue = context.SimpleQueue()
    procs = [context.Process(target=_rank_main, args=(rank, port, device_type, op_overhead, queue), daemon=True)
             for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        for p in procs:
            if p.is_alive():
                p.kill()
        raise RuntimeError(f"calibrate: the two-rank link measurement failed (exit codes "
                           f"{[p.exitcode for p in procs]})")
    return queue.get()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, device_type: str, op_overhead: float, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    backend = "gloo" if device_type == "cpu" else "nccl"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=2)
    try:
        # an all_reduce between two ranks takes 2 * latency + bytes / bandwidth (collective_seconds,
        # n = 2): a tiny one gives the latency, a large one then the bandwidth
        small, large = torch.ones(2, device=device_type), torch.ones(2**20, device=device_type)  # 8 B, 4 MiB
        latency = _timed(lambda: dist.all_reduce(small), device_type, 0.0, runs=50) / 2
        seconds = _timed(lambda: dist.all_reduce(large), device_type, 0.0, runs=6)
        link = (large.numel() * large.element_size() / max(seconds - 2 * latency, 1e-9), latency)
        agreed = [None, None]
        dist.all_gather_object(agreed, link)
    finally:
        dist.destroy_process_group()
    if rank == 0:  # both ranks' fits, averaged: each saw the same collectives
        bandwidth, latency = (statistics.mean(v) for v in zip(*agreed))
        queue.put((bandwidth, latency, _dtensor_overhead(device_type, op_overhead)))


def _dtensor_overhead(device_type: str, op_overhead: float) -> float:
    """Extra seconds per op of a tensor-parallel program: the probe model made tensor parallel over
    two ranks as transformers are (sequence-parallel norms, column- then row-parallel linears,
    torch's ``parallelize_module``), run on one rank of a fake world (collectives return at once),
    its step's time less its ops at the plain overhead, over its ops."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    from ndweave.mesh import init_device_mesh
    from ndweave.mesh import fake_world

    with fake_world(2):
        mesh = init_device_mesh(device_type, (2,), mesh_dim_names=("TP",))["TP"]
        model = _probe_model(device_type)
        plan = {}
        for i in range(0, len(model), 4):  # LayerNorm, Linear, GELU, Linear
            plan.update({str(i): SequenceParallel(), str(i + 1): ColwiseParallel(input_layouts=Shard(1)),
                         str(i + 3): RowwiseParallel(output_layouts=Shard(1))})
        model = parallelize_module(model, mesh, plan)
        # this rank's half of the sequence
        seconds, work = _timed_step(model, torch.randn(4, 4, 32, device=device_type), device_type)
    return max(seconds - work.ops * op_overhead, 0.0) / max(work.ops, 1)
