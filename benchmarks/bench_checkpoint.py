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
* ``ndweave async``: the time ``save(..., async_checkpoint=True)`` blocks (planning plus the copy
  off the live tensors), against the sync save; ``staged MB`` is the extra host memory it holds
  per rank until the files are written;
* ``ndweave load`` / ``dcp.load``: reading it back into the same layout.

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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from common import init_rank, spawn, sync

OPS = ("ndweave save", "dcp.save", "raw write", "ndweave save, pieces", "ndweave async (blocking)",
       "ndweave load", "dcp.load")


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


def _timed(device, fn) -> float:
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    dist.barrier()
    return time.perf_counter() - t0


def _raw_write(path: str, tensors: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors.values():
            f.write(t.to_local().cpu().numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def _worker(rank: int, world: int, port: int, args, folder: str, queue) -> None:
    from ndweave.checkpoint import load, save

    device = init_rank(rank, world, port, args.device, args.threads)
    mesh = init_device_mesh(device.type, (world,))
    rows = int(args.mb * 2**20 / 4 / args.tensors / 1024)
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": distribute_tensor(torch.randn(rows, 1024, generator=g).to(device), mesh, [Shard(0)])
               for i in range(args.tensors)}
    pieces = _Pieces(tensors, rank, world)
    times: dict[str, list[float]] = {op: [] for op in OPS}
    staged = 0
    for r in range(args.rounds):
        def path(name: str) -> str:
            return f"{folder}/{name}-{r}"

        saves = [("ndweave save", lambda: save(path("ours"), {"model": tensors})),
                 ("dcp.save", lambda: dcp.save({"model": tensors}, checkpoint_id=path("dcp")))]
        for op, fn in saves if r % 2 == 0 else saves[::-1]:  # alternate who goes first
            times[op].append(_timed(device, fn))
        if rank == 0:
            os.makedirs(path("raw"), exist_ok=True)
        dist.barrier()
        times["raw write"].append(_timed(device, lambda: _raw_write(f"{path('raw')}/{rank}.bin", tensors)))
        times["ndweave save, pieces"].append(_timed(device, lambda: save(path("pieces"), {"optimizer": pieces})))
        handles = []
        times["ndweave async (blocking)"].append(
            _timed(device, lambda: handles.append(save(path("async"), {"model": tensors}, async_checkpoint=True))))
        staged = handles[0].staged_bytes
        handles[0].wait()
        loads = [("ndweave load", lambda: load(path("ours"), {"model": tensors})),
                 ("dcp.load", lambda: dcp.load({"model": tensors}, checkpoint_id=path("dcp")))]
        for op, fn in loads if r % 2 == 0 else loads[::-1]:
            times[op].append(_timed(device, fn))
        dist.barrier()
        if rank == 0:
            for name in ("ours", "dcp", "raw", "pieces", "async"):
                shutil.rmtree(path(name), ignore_errors=True)
    if rank == 0:
        queue.put({"times": {op: statistics.median(ts) for op, ts in times.items()}, "staged": staged,
                   "bytes": sum(t.numel() * t.element_size() for t in tensors.values())})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mb", type=float, default=256.0, help="total state size (MB)")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    print(f"{args.mb:.0f} MB of float32 in {args.tensors} Shard(0) DTensors, {args.device}, {args.rounds} rounds")
    for world in args.world_sizes:
        folder = tempfile.mkdtemp(prefix="ndweave-bench-ckpt-", dir=args.dir)
        try:
            result = spawn(_worker, world, args, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        t, gb = result["times"], result["bytes"] / 1e9
        print(f"\nworld {world}")
        print(f"{'':26} {'ms':>9} {'GB/s':>7} {'ours/this':>9}")
        for op in OPS:
            ours = t["ndweave load"] if "load" in op else t["ndweave save"]
            print(f"{op:26} {t[op] * 1e3:9.1f} {gb / t[op]:7.2f} {ours / t[op]:9.2f}")
        print(f"async save blocks for {t['ndweave async (blocking)'] / t['ndweave save']:.0%} of a sync save; "
              f"staged host memory {result['staged'] / 2**20:.1f} MB per rank")


if __name__ == "__main__":
    main()
