"""ndweave DDP vs torch DDP: step time, peak memory, and all-reduce bus bandwidth.

    python benchmarks/bench_ddp.py                       # world sizes 2 and 4, CPU/gloo
    python benchmarks/bench_ddp.py --world-sizes 2 --steps 30 --layers 8 --width 1024

Same plain model (an MLP), same data, same bucket size (``--bucket-mb``, torch's ``bucket_cap_mb``),
plain SGD. Per world size it prints:

* step time (forward + backward + sync + optimizer step), median over interleaved rounds, and the
  ratio ours / torch (target: <= 0.95); in wall time and in the busiest rank's CPU time (the figure
  other jobs on a shared machine disturb less);
* peak memory per rank: CUDA's max allocated bytes on GPUs; on CPU the growth of the process's peak
  RSS from just before wrapping to the end of training (each framework in fresh processes);
* the bus bandwidth our bucketed all-reduce achieves (``finish_grad_sync`` with overlap off, so it
  is pure communication) next to a raw ``all_reduce`` of the same bytes in one tensor.
  Bus bandwidth = bytes / time * 2 (n - 1) / n, the nccl-tests convention.
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import time

import torch
import torch.distributed as dist

from common import Row, add_common_args, close, emit, init_rank, interleaved, mlp, spawn, sync


def _model(args) -> torch.nn.Module:
    return mlp(args.layers, args.width)


def _wrap(kind: str, model, args, device):
    bucket_elems = int(args.bucket_mb * 2**20) // 4
    if kind == "ndweave":
        from ndweave.ddp import DDP
        from ndweave.mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("DP",))
        return DDP(model, mesh["DP"], bucket_size=bucket_elems)
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_mb)


def _step(ddp, opt, x, y):
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(rank: int, world: int, port: int, mode: str, kind: str, args, queue) -> None:
    device = init_rank(rank, world, port, args.device, args.threads)
    use_cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
    result = {}
    if mode == "time":
        runs = {}
        for k in ("ndweave", "torch"):
            model = _model(args).to(device)
            ddp = _wrap(k, model, args, device)
            runs[k] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
            for _ in range(args.warmup):
                _step(*runs[k], x, y)
        timing = interleaved({k: functools.partial(_step, *run, x, y) for k, run in runs.items()}, device,
                             args.rounds, args.steps)
        result = {k: (t.wall, t.cpu) for k, t in timing.items()}
        result.update(_bandwidth(runs["ndweave"][0], args, device))
    else:  # mode == "memory": one framework per process
        model = _model(args).to(device)
        sync(device)
        if use_cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        else:
            base = _rss_bytes()
        ddp = _wrap(kind, model, args, device)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        for _ in range(args.warmup + 2):
            _step(ddp, opt, x, y)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) if use_cuda else _rss_bytes()
        result = {"peak_growth": peak - base}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        queue.put(gathered)
    close()


def _bandwidth(ddp, args, device) -> dict:
    """Bus bandwidth of our bucketed all-reduce vs one raw all_reduce of the same bytes."""
    world = dist.get_world_size()
    nbytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.grad_buckets())
    factor = 2 * (world - 1) / world
    ddp.overlap_grad_reduce = False  # finish_grad_sync then launches every bucket: pure comm
    ddp.finish_grad_sync_in_backward = False
    x = torch.randn(args.batch, args.width, device=device)
    ours, raw = [], []
    flat = torch.randn(nbytes // 4, device=device)
    for _ in range(args.rounds * 2):
        torch.nn.functional.mse_loss(ddp(x), torch.zeros(args.batch, 10, device=device)).backward()
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        ddp.finish_grad_sync()
        sync(device)
        ours.append(time.perf_counter() - t0)
        ddp.zero_grad_buffer()
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        sync(device)
        raw.append(time.perf_counter() - t0)
    return {
        "bytes": nbytes,
        "ours_busbw": nbytes / statistics.median(ours) * factor,
        "raw_busbw": nbytes / statistics.median(raw) * factor,
        "num_buckets": len(ddp.grad_buckets()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    numel = sum(p.numel() for p in _model(args).parameters())
    print(f"model: {args.layers}x Linear({args.width}, {args.width}) + head, {numel / 1e6:.1f}M params; "
          f"batch {args.batch}/rank; bucket {args.bucket_mb} MiB; device {args.device}")
    header = f"{'world':>5} | {'ours ms':>8} | {'torch ms':>8} | {'ratio':>5} | {'ours CPU ms':>11} | " \
             f"{'torch CPU ms':>12} | {'ratio':>5} | {'ours peak MiB':>13} | {'torch peak MiB':>14} | " \
             f"{'ours busbw GB/s':>15} | {'raw busbw GB/s':>14}"
    print(header, flush=True)
    rows = []
    for world in args.world_sizes:
        timing = spawn(_worker, world, "time", "", args)
        memory = {k: max(r["peak_growth"] for r in spawn(_worker, world, "memory", k, args)) for k in ("ndweave", "torch")}
        (ours, ours_cpu), (theirs, theirs_cpu) = timing[0]["ndweave"], timing[0]["torch"]
        bw = timing[0]
        mib = {k: v / 2**20 for k, v in memory.items()}
        print(
            f"{world:>5} | {ours * 1e3:>8.2f} | {theirs * 1e3:>8.2f} | {ours / theirs:>5.2f} | "
            f"{ours_cpu * 1e3:>11.2f} | {theirs_cpu * 1e3:>12.2f} | {ours_cpu / theirs_cpu:>5.2f} | "
            f"{mib['ndweave']:>13.1f} | {mib['torch']:>14.1f} | "
            f"{bw['ours_busbw'] / 1e9:>15.2f} | {bw['raw_busbw'] / 1e9:>14.2f}",
            flush=True,
        )
        rows.append(Row("ndweave.ddp", f"torch DDP step, {numel / 1e6:.1f}M-param MLP, {args.bucket_mb:g} MiB buckets",
                        world, ours / theirs, ours_cpu / theirs_cpu,
                        memory=f"peak {'RSS ' if args.device == 'cpu' else ''}growth {mib['ndweave']:.0f} vs "
                               f"{mib['torch']:.0f} MiB",
                        note=f"CPU ms/step ours {ours_cpu * 1e3:.1f}, torch {theirs_cpu * 1e3:.1f}; busbw "
                             f"{bw['ours_busbw'] / 1e9:.2f} vs one raw all_reduce {bw['raw_busbw'] / 1e9:.2f} GB/s"))
    print(f"(ratio = ours / torch: wall and the busiest rank's CPU time per step, medians of {args.rounds} "
          f"interleaved rounds; busbw over {bw['num_buckets']} buckets of {bw['bytes'] / 2**20:.1f} MiB in all vs "
          f"one raw all_reduce of the same bytes)")
    emit(rows, args.json)

if __name__ == "__main__":
    main()
