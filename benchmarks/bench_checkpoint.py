"""ndweave.checkpoint save/load vs plain torch DCP vs a raw sequential write of the same bytes.

    python benchmarks/bench_checkpoint.py                       # world sizes 2 and 4, CPU/gloo
    python benchmarks/bench_checkpoint.py --mb 512 --world-sizes 2 --device cuda

The state: ``--tensors`` float32 tensors of ``--mb`` MB in all, ``Shard(0)`` DTensors over every
rank (what plain DCP saves natively). Per world size, interleaved over ``--rounds`` rounds (medians;
every timing from a barrier to a barrier, so the slowest rank sets it):

* ``ndweave save``: ``ndweave.checkpoint.save`` (sync), commit included;
* ``dcp.save``: ``torch.distributed.checkpoint.save`` of the same state dict, same writer settings;
* ``raw write``: each rank writes its shards' bytes to one file and fsyncs it (the floor);
* ``ndweave save, pieces``: the same tensors as a sharded optimizer holds them, flat ranges of the
  global tensor cutting rows anywhere (``StatePiece``s, which plain DCP cannot save);
* ``ndweave load`` / ``dcp.load``: reading it back into the same layout.

Each with the CPU time of the busiest rank (all its threads), which a busy machine disturbs less
than the wall time.

The saved state is a training state: the tensors as the parameters of a module and an optimizer
(SGD) over them, ``{"model": module, "optimizer": optimizer}`` (their state dicts for plain DCP).
Async saving is measured as a user feels it, in a loop of simulated training steps of ``--step-ms``
that do not touch the saved tensors, then ``optimizer.step()`` updating all of them in place; the
async saves plan on a gloo group of their own, as ``CheckpointManager``'s do. Two kinds of step:

* ``host``: matmuls on the CPU. Here the save's background copy and writes take cores from the
  step (2 ranks on 2 cores have none to spare): the worst case, a CPU-only training job;
* ``device``: the host sleeps through the step's compute, as it waits for an accelerator: the
  background thread has the host to itself, as in GPU training.

``the call`` is the time ``save(..., async_checkpoint=True)`` itself takes; ``blocks for`` is the
extra time a step with the save in front takes over a step without (the call, the copy the step
waits for, and what the background thread took from the step), both against the extra time of a
step with a sync save; ``then`` is the extra time of the ``--after`` following steps plus ``wait()``
(the files being written beside training); ``staged MB`` the extra host memory the save holds per
rank until its files are written. Both with fresh host memory (the default) and with
``StagingBuffers`` reused from earlier saves.

``ours/this`` is ndweave's time over the row's: below 1 means ndweave is faster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from common import Row, add_common_args, close, emit, init_rank, measure, spawn

OPS = ("ndweave save", "dcp.save", "raw write", "ndweave save, pieces", "ndweave load", "dcp.load")
KINDS = ("host", "device")
VARIANTS = ("", ", reused buffers")
STEPS = tuple(f"{kind}: {what}" for kind in KINDS for what in (
    "step", "step + sync save", *(f"{w}{v}" for v in VARIANTS for w in ("the call", "step + async save", "after async save"))))


class _Pieces:
    """The tensors as a sharded optimizer's state: rank r holds flat range r of each global tensor."""

    def __init__(self, tensors: dict[str, torch.Tensor], rank: int, world: int) -> None:
        from ndweave.mesh.contracts import ShardLayout, StatePiece

        self.pieces = {}
        for name, t in tensors.items():
            full = t.full_tensor().reshape(-1)
            lo, hi = full.numel() * rank // world, full.numel() * (rank + 1) // world
            self.pieces[name] = StatePiece(name, full[lo:hi].clone(), ShardLayout.whole(t.shape), lo, hi)

    def state_dict(self):
        return dict(self.pieces)

    def load_state_dict(self, state_dict):
        self.pieces = dict(state_dict)


class _Training:
    """The saved tensors as parameters, an SGD over them (fixed grads), and a step: ``matmuls``
    products of a ``size`` x ``size`` matrix that touch no saved tensor (``host``) or a sleep as long
    (``device``), then ``optimizer.step()``."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device, step_ms: float, size: int = 256) -> None:
        self.module = nn.ParameterDict({name: nn.Parameter(t) for name, t in tensors.items()})
        for p in self.module.parameters():
            p.grad = torch.full_like(p, 1e-6)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=1e-3)
        self.state = {"model": self.module, "optimizer": self.optimizer}
        self.x = torch.randn(size, size, device=device)
        self.matmuls = 1
        per = measure(lambda: self.x @ self.x, device, 20)[0]
        count = torch.tensor([max(1, round(step_ms / 1e3 / per))])
        dist.broadcast(count, 0)  # every rank does the same work
        self.matmuls, self.step_s = int(count), step_ms / 1e3
        self.kind = "host"

    def dcp_state(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def step(self) -> None:
        if self.kind == "device":
            time.sleep(self.step_s)
        else:
            for _ in range(self.matmuls):
                self.x @ self.x
        self.optimizer.step()


def _raw_write(path: str, tensors: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors.values():
            f.write(t.to_local().cpu().numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def _worker(rank: int, world: int, port: int, args, folder: str, queue) -> None:
    from ndweave.checkpoint import StagingBuffers, load, save

    device = init_rank(rank, world, port, args.device, args.threads)
    mesh = init_device_mesh(device.type, (world,))
    rows = int(args.mb * 2**20 / 4 / args.tensors / 1024)
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": distribute_tensor(torch.randn(rows, 1024, generator=g).to(device), mesh, [Shard(0)])
               for i in range(args.tensors)}
    pieces = _Pieces(tensors, rank, world)
    train = _Training(tensors, device, args.step_ms)
    group = dist.new_group(backend="gloo")  # async saves plan on it, in their background thread
    buffers = StagingBuffers()  # touched once here, as by a run's earlier saves
    save(f"{folder}/warm-up", train.state, async_checkpoint=True, buffers=buffers, process_group=group).wait()
    times: dict[str, list[float]] = {op: [] for op in (*OPS, *STEPS)}
    cpu: dict[str, list[float]] = {op: [] for op in OPS}
    staged = 0
    for r in range(args.rounds):
        def path(name: str) -> str:
            return f"{folder}/{name}-{r}"

        def timed(op: str, fn) -> None:
            wall, busiest = measure(fn, device)
            times[op].append(wall)
            if op in cpu:
                cpu[op].append(busiest)

        saves = [("ndweave save", lambda: save(path("ours"), train.state)),
                 ("dcp.save", lambda: dcp.save(train.dcp_state(), checkpoint_id=path("dcp")))]
        for op, fn in saves if r % 2 == 0 else saves[::-1]:  # alternate who goes first
            timed(op, fn)
        if rank == 0:
            os.makedirs(path("raw"), exist_ok=True)
        dist.barrier()
        timed("raw write", lambda: _raw_write(f"{path('raw')}/{rank}.bin", tensors))
        timed("ndweave save, pieces", lambda: save(path("pieces"), {"optimizer": pieces}))
        loads = [("ndweave load", lambda: load(path("ours"), train.state)),
                 ("dcp.load", lambda: dcp.load(train.dcp_state(), checkpoint_id=path("dcp")))]
        for op, fn in loads if r % 2 == 0 else loads[::-1]:
            timed(op, fn)

        for kind in KINDS:
            train.kind = kind
            plain = [measure(train.step, device)[0] for _ in range(3)]
            times[f"{kind}: step"].append(statistics.median(plain))
            timed(f"{kind}: step + sync save", lambda: (save(path(f"sync-{kind}"), train.state), train.step()))
            for suffix, kept in zip(VARIANTS, (None, buffers)):
                handles, call = [], []

                def async_save_and_step() -> None:
                    t0 = time.perf_counter()
                    handles.append(save(path(f"async-{kind}{suffix}"), train.state, async_checkpoint=True,
                                        buffers=kept, process_group=group))
                    call.append(time.perf_counter() - t0)
                    train.step()

                timed(f"{kind}: step + async save{suffix}", async_save_and_step)
                times[f"{kind}: the call{suffix}"].append(call[0])
                after = [measure(train.step, device)[0] for _ in range(args.after)]
                after.append(measure(handles[0].wait, device)[0])
                times[f"{kind}: after async save{suffix}"].append(sum(after))
        staged = handles[0].staged_bytes
        dist.barrier()
        if rank == 0:
            for name in os.listdir(folder):
                if name.endswith(f"-{r}"):
                    shutil.rmtree(f"{folder}/{name}", ignore_errors=True)
    if rank == 0:
        queue.put({"times": {op: statistics.median(ts) for op, ts in times.items()},
                   "cpu": {op: statistics.median(ts) for op, ts in cpu.items()}, "staged": staged,
                   "matmuls": train.matmuls, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())})
    close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--mb", type=float, default=256.0, help="total state size (MB)")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--step-ms", type=float, default=40.0, help="matmul time of a simulated training step")
    parser.add_argument("--after", type=int, default=3, help="steps timed after the async save's step")
    args = parser.parse_args()
    print(f"{args.mb:.0f} MB of float32 in {args.tensors} Shard(0) DTensors, {args.device}, {args.rounds} rounds")
    rows = []
    for world in args.world_sizes:
        folder = tempfile.mkdtemp(prefix="ndweave-bench-ckpt-", dir=args.dir)
        try:
            result = spawn(_worker, world, args, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        t, c, gb = result["times"], result["cpu"], result["bytes"] / 1e9
        print(f"\nworld {world}")
        print(f"{'':26} {'ms':>9} {'GB/s':>7} {'ours/this':>9} {'CPU ms':>9} {'ours/this':>9}")
        for op in OPS:
            ours = t["ndweave load"] if "load" in op else t["ndweave save"]
            line = f"{op:26} {t[op] * 1e3:9.1f} {gb / t[op]:7.2f} {ours / t[op]:9.2f}"
            ours_cpu = c["ndweave load"] if "load" in op else c["ndweave save"]
            print(line + f" {c[op] * 1e3:9.1f} {ours_cpu / c[op]:9.2f}")
        blocks = {}
        for kind in KINDS:
            step, sync_save = t[f"{kind}: step"], t[f"{kind}: step + sync save"] - t[f"{kind}: step"]
            what = f"{result['matmuls']} matmuls" if kind == "host" else f"{args.step_ms:g} ms asleep"
            print(f"{kind} step ({what} + SGD step) {step * 1e3:.1f} ms; a sync save in front adds "
                  f"{sync_save * 1e3:.1f} ms")
            for suffix in VARIANTS:
                call = t[f"{kind}: the call{suffix}"]
                blocked = t[f"{kind}: step + async save{suffix}"] - step
                blocks[kind + suffix] = (call / sync_save, blocked / sync_save)
                then = t[f"{kind}: after async save{suffix}"] - args.after * step
                print(f"  async{suffix}: the call {call / sync_save:.0%} of a sync save ({call * 1e3:.1f} ms), "
                      f"blocks the step for {blocked / sync_save:.0%} ({blocked * 1e3:.1f} ms); then "
                      f"{then * 1e3:.1f} ms over the next {args.after} steps + wait()")
        staged = result["staged"] / 2**20
        print(f"staged host memory {staged:.1f} MB per rank")
        state = f"{args.mb:g} MB of DTensors + SGD"
        rows += [
            Row("ndweave.checkpoint save", f"dcp.save, {state}", world, t["ndweave save"] / t["dcp.save"],
                c["ndweave save"] / c["dcp.save"], memory=f"async: {staged:.0f} MB staged/rank",
                bound=f"raw write floor: ours {t['ndweave save'] / t['raw write']:.2f}x",
                note=f"{t['ndweave save'] * 1e3:.0f} ms; async (reused buffers), of a sync save: the call "
                     f"{blocks['device, reused buffers'][0]:.0%}, a {args.step_ms:g} ms step blocked "
                     f"{blocks['device, reused buffers'][1]:.0%} on a device, {blocks['host, reused buffers'][1]:.0%} "
                     "on the CPU"),
            Row("ndweave.checkpoint load", f"dcp.load, {state}", world, t["ndweave load"] / t["dcp.load"],
                c["ndweave load"] / c["dcp.load"], note=f"{t['ndweave load'] * 1e3:.0f} ms"),
        ]
    emit(rows, args.json)

if __name__ == "__main__":
    main()
