"""How much of DDP's grad reduction hides behind backward, on a simulated device, against the theory.

    python benchmarks/bench_overlap.py                    # 2 and 4 ranks, 16 blocks, 10 ms kernels
    python benchmarks/bench_overlap.py --world-sizes 2 --kernel-ms 20 --bucket-mb 4

The model is ``ndweave.pipeline.testing.KernelStack``: blocks of ``Linear(width)`` whose simulated
device kernel sleeps (forward F ms, backward 2F ms: ``time.sleep`` leaves the CPU free, as a GPU
kernel does), so the reductions, which run on gloo's thread, have a core while backward "computes",
even on 2 shared cores. A block's weight is ``width^2`` fp32 (4 MiB at width 1024): one bucket each.

Per world size and wrapper (ndweave's DDP, its ZeRO-2, torch's DDP, and "by hand": each grad
all-reduced the moment it lands, no buckets, no checks, this machine's floor), timed in interleaved
rounds:

* the step (forward, backward, every reduction finished; no optimizer step), wall time, and the
  same forward and backward with no wrapper (nothing to reduce);
* ``W``: how long each step goes on after backward's compute has ended (the input's grad, the
  backward's last op, stamps it), less the same without a wrapper: the reductions left waiting;
* ``C``: the reductions alone: every bucket's bytes all-reduced (ZeRO-2: reduce-scattered) back to
  back, as an unoverlapped sync would;
* hidden = ``1 - W / C``: the share of the reduction that backward covered (the rank that hid least).

The theory: a bucket's reduction starts when its last grad lands, so everything but the last
bucket's (the first block's, which fills at the end of backward) can hide, if each reduction takes
less than the backward of the block before it: ``1 - c_last / C`` (``c_last``: that bucket's time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from common import Row, add_common_args, close, emit, init_rank, interleaved, spawn, sync


def _model(args) -> torch.nn.Module:
    from ndweave.pipeline.testing import KernelStack

    torch.manual_seed(0)
    model = KernelStack(args.layers, args.width, args.kernel_ms)
    if args.compile:  # each block in place, before a wrapper's hooks (the simulated kernel breaks its graph)
        for block in model.layers:
            block[0].compile()
    return model


class _ByHand(torch.nn.Module):
    """The least an overlapped sync can be: each grad all-reduced (async) the moment it lands, all
    waited for at the end of backward. No buckets, no checks: this machine's floor."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module, self.works = module, []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, param: torch.Tensor) -> None:
        if not self.works:
            torch.autograd.Variable._execution_engine.queue_callback(self._wait)
        self.works.append(dist.all_reduce(param.grad, async_op=True))

    def _wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _wrap(kind: str, model: torch.nn.Module, args, device: torch.device):
    bucket = int(args.bucket_mb * 2**20) // 4
    if kind == "by_hand":
        return _ByHand(model)
    if kind == "torch":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb)
    from ndweave.ddp import DDP
    from ndweave.mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("DP",))
    return DDP(model, mesh["DP"], bucket_size=bucket, zero_stage=2 if kind == "zero2" else 1)


class _Mark(torch.autograd.Function):
    """The identity; its backward, the step's last op (it takes the input's grad, after the first
    block's), records when backward's compute ended."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, times: list) -> torch.Tensor:
        ctx.times = times
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.times.append(time.perf_counter())
        return grad, None


def _step(module, x, waits: list[float]) -> None:
    """Forward and backward (DDP's backward finishes its reductions before it returns); ``waits`` gets
    how long the step went on after backward's compute: the reductions it did not hide."""
    marks: list[float] = []
    module(_Mark.apply(x, marks)).sum().backward()
    waits.append(time.perf_counter() - marks[0])
    if hasattr(module, "zero_grad_buffer"):  # (ndweave's: grads live in its buffers)
        module.zero_grad_buffer()
    else:
        module.zero_grad(set_to_none=False)


def _reductions(buckets: list[int], reduce_scatter: bool, device: torch.device, rounds: int) -> tuple[float, float]:
    """Seconds to reduce buckets of these byte sizes back to back (as a sync after backward would), and
    the last one's alone (the first block's bucket: the one no backward is left to hide)."""
    world = dist.get_world_size()
    flats = [torch.randn(n // 4, device=device) for n in buckets]
    outs = [torch.empty(f.numel() // world, device=device) for f in flats]

    def reduce(pieces) -> float:
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        works = [dist.reduce_scatter_tensor(outs[i], flats[i], async_op=True) if reduce_scatter
                 else dist.all_reduce(flats[i], async_op=True) for i in pieces]
        for work in works:
            work.wait()
        sync(device)
        return time.perf_counter() - start

    everything = statistics.median(reduce(range(len(flats))) for _ in range(rounds))
    last = statistics.median(reduce([len(flats) - 1]) for _ in range(rounds))
    return everything, last


def _bucket_bytes(wrapped, kind: str) -> list[int]:
    """The wrapper's buckets' grad bytes, in the order backward fills them (the last: the first block's)."""
    if kind in ("torch", "by_hand"):  # torch's reducer: one bucket per block's weight and bias here
        sizes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in wrapped.module.layers]
        return sizes[::-1]
    shards = dist.get_world_size() if kind == "zero2" else 1  # (ZeRO-2 keeps 1/DP of each bucket)
    return [b.grad_data.numel() * shards * b.grad_data.element_size() for b in wrapped.grad_buckets()]


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    device = init_rank(rank, world, port, args.device, args.threads)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank)).to(device)
    x.requires_grad_()  # (backward reaches the input: _Mark's backward is its last op)
    bare = _model(args).to(device)
    wrapped = {kind: _wrap(kind, _model(args).to(device), args, device) for kind in args.wrappers}
    waits: dict[str, list[float]] = {kind: [] for kind in ("bare", *wrapped)}
    steps = {"bare": lambda: _step(bare, x, waits["bare"]),
             **{k: (lambda m=m, k=k: _step(m, x, waits[k])) for k, m in wrapped.items()}}
    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    for kind in waits:
        waits[kind].clear()
    timing = interleaved(steps, device, args.rounds, args.steps)
    result = {}
    for kind, module in wrapped.items():
        buckets = _bucket_bytes(module, kind)
        comm, last = _reductions(buckets, kind == "zero2", device, args.rounds)
        wait = statistics.median(waits[kind]) - statistics.median(waits["bare"])
        result[kind] = {"step": timing[kind].wall, "cpu": timing[kind].cpu, "bare": timing["bare"].wall,
                        "comm": comm, "wait": wait, "hidden": 1 - wait / comm, "theory": 1 - last / comm,
                        "buckets": len(buckets), "mib": sum(buckets) / 2**20}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:  # (the rank that waited longest after its backward: its peers' reductions hold it)
        queue.put({kind: min((r[kind] for r in gathered), key=lambda r: r["hidden"]) for kind in result})
    close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kernel-ms", type=float, default=10.0, help="a block's forward sleeps this; backward twice")
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--wrappers", nargs="+", default=["ndweave", "zero2", "torch", "by_hand"],
                        choices=["ndweave", "zero2", "torch", "by_hand"])
    parser.add_argument("--compile", action="store_true", help="compile each block's Linear (inductor)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(f"model: {args.layers} blocks of Linear({args.width}){' compiled' if args.compile else ''} + a "
          f"{args.kernel_ms:g} ms kernel (backward {2 * args.kernel_ms:g} ms); batch {args.batch}/rank; buckets "
          f"{args.bucket_mb:g} MiB; device {args.device}")
    print(f"{'world':>5} | {'wrapper':>8} | {'step ms':>8} | {'no-sync ms':>10} | {'reduce ms':>9} | "
          f"{'hidden':>6} | {'theory':>6} | {'buckets':>7}", flush=True)
    rows = []
    for world in args.world_sizes:
        result = spawn(_worker, world, args)
        for kind, r in result.items():
            print(f"{world:>5} | {kind:>8} | {r['step'] * 1e3:>8.1f} | {r['bare'] * 1e3:>10.1f} | "
                  f"{r['comm'] * 1e3:>9.1f} | {r['hidden']:>6.0%} | {r['theory']:>6.0%} | {r['buckets']:>7}",
                  flush=True)
        if "ndweave" in result and "torch" in result:
            ours, theirs = result["ndweave"], result["torch"]
            others = "; ".join(f"{name} {result[kind]['hidden']:.0%}" for kind, name in
                               (("zero2", "ZeRO-2"), ("torch", "torch"), ("by_hand", "by hand")) if kind in result)
            rows.append(Row(
                "ndweave.ddp", f"torch DDP, overlap on a simulated device ({args.layers} x {args.kernel_ms:g} ms "
                f"kernels, {ours['mib']:.0f} MiB of grads, {args.bucket_mb:g} MiB buckets"
                f"{', blocks compiled' if args.compile else ''})", world,
                ours["step"] / theirs["step"], ours["cpu"] / theirs["cpu"],
                bound=f"hidden {ours['hidden']:.0%} ({others}) of the reduction, theory {ours['theory']:.0%}",
                note=f"step {ours['step'] * 1e3:.0f} vs {theirs['step'] * 1e3:.0f} ms; no-sync step "
                     f"{ours['bare'] * 1e3:.0f} ms; reductions alone {ours['comm'] * 1e3:.0f} ms"))
    print("(hidden = 1 - the wait after backward's compute / the reductions alone; theory = 1 - the last bucket's "
          "reduction / all)")
    emit(rows, args.json)


if __name__ == "__main__":
    main()
