"""ndweave DistributedOptimizer vs torch's ZeroRedundancyOptimizer vs unsharded Adam.

    python benchmarks/bench_optim.py                     # world sizes 2 and 4, CPU/gloo
    python benchmarks/bench_optim.py --world-sizes 2 --layers 8 --width 1024 --device cuda

Same plain MLP, same data, Adam, plain data parallelism:

* ``unsharded``: torch DDP + torch.optim.Adam (every rank holds all optimizer state);
* ``torch-zero``: torch DDP + ``ZeroRedundancyOptimizer(Adam)`` (whole parameters per rank);
* ``ndweave``: ndweave DDP (``use_distributed_optimizer=True``) + ``DistributedOptimizer(Adam)``
  (flat bucket ranges per rank, fp32 master = the fp32 model's own range, all-gather after step).
  Without ndweave-ddp installed it falls back to ``ndweave.mesh.testing.ReferenceDataParallel``;
* ``ndweave+overlap``: the same with ``overlap_param_gather=True`` (the all-gather runs under the
  next forward, so it leaves ``step ms`` and shows in ``iter ms`` only where it is not hidden);
* ``ndweave-zero2``: ``ndweave`` with ``DDP(..., zero_stage=2)``: grads kept as 1/DP shards;
* ``ndweave-unchecked``: ``ndweave`` without its two per-step checks, as torch's DDP and
  ``ZeroRedundancyOptimizer`` run: ``DDP(..., detect_desync=False)`` (no comparison of the ranks'
  counters after backward and before the step) and ``on_nonfinite="unchecked"`` (no grad norm when
  nothing clips). DDP's check is one small collective a step here (before the optimizer's
  collectives; the one after backward rides the last bucket's all-reduce on gloo); the norm none,
  since DDP all-reduces whole buckets on gloo (one all-reduce where each rank holds only its range).

Per world size it prints, side by side: iteration time (forward + backward + step; mean over the
steps barrier to barrier, median over interleaved rounds), the busiest rank's CPU time per iteration
(the figure other jobs on a shared machine disturb less), each with ``ours/this`` (ndweave's time
over this row's: below 1 means ndweave is faster); ``opt.step()`` time alone (for ndweave this
includes finishing the grad reduce-scatter and the parameter all-gather; for torch DDP the all-reduce
is in backward); optimizer-state bytes per rank (state tensors + separate master weights) and their
ratio to unsharded / DP (ndweave's target: 1.00 within 2%). Then where the CPU goes: the busiest
rank's CPU per phase of the iteration (``zero_grad``, forward, backward, step) for each kind, and what
one small gloo collective costs the busiest rank (five ints gathered; DDP's check makes one such
collective a step here).

Then, in fresh processes per ZeRO stage (``--memory-bucket-mb`` buckets), the busiest rank's peak bytes of live tensors over two steps
(``ndweave.mesh.testing.memory.TensorMemory``; model, buffers and state included) against the theory
for an fp32 model with Adam (masters are the model's own ``param_data``): params 4Ψ + grads (4Ψ at
ZeRO-1, 4Ψ/N at ZeRO-2) + Adam 8Ψ/N, + at ZeRO-2 the full-size buckets in flight, + the largest
param's grad as autograd hands it to DDP's hook. (Nothing for gloo: DDP all-reduces the buckets in
place there, where gloo's reduce-scatter held a copy of each.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from common import Row, add_common_args, close, emit, init_rank, measure, mlp, spawn, sync

KINDS = ("unsharded", "torch-zero", "ndweave", "ndweave+overlap", "ndweave-zero2", "ndweave-unchecked")
PHASES = ("zero_grad", "forward", "backward", "step")  # the iteration's parts, as the CPU table splits it
SMALL_CALLS = 100


def _model(args) -> torch.nn.Module:
    return mlp(args.layers, args.width)


def _ndweave_ddp(model, device, args, zero_stage: int = 1, bucket_mb: float | None = None, checked: bool = True):
    bucket = int((args.bucket_mb if bucket_mb is None else bucket_mb) * 2**20) // 4
    try:
        from ndweave.ddp import DDP
        from ndweave.mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("DP",))
        return (DDP(model, mesh["DP"], bucket_size=bucket, zero_stage=zero_stage, detect_desync=checked),
                "ndweave.ddp")
    except ImportError:
        from ndweave.mesh.testing import ReferenceDataParallel

        return ReferenceDataParallel(model, dist.group.WORLD, bucket_size=bucket, use_distributed_optimizer=True), \
            "reference"


def _build(kind: str, model, device, args):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ids = [device.index] if device.type == "cuda" else None
    if kind.startswith("ndweave"):
        from ndweave.optim import DistributedOptimizer

        checked = not kind.endswith("unchecked")
        ddp, source = _ndweave_ddp(model, device, args, zero_stage=2 if kind.endswith("zero2") else 1,
                                   checked=checked)
        opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-4},
                                   overlap_param_gather=kind.endswith("overlap"),
                                   on_nonfinite="raise" if checked else "unchecked")
        return ddp, opt, source
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_mb)
    if kind == "torch-zero":
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4), ""
    return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4), ""


def _state_bytes(kind: str, opt) -> int:
    if kind.startswith("ndweave"):
        return opt.optimizer_state_bytes() + opt.master_param_bytes()
    state = opt.optim.state if kind == "torch-zero" else opt.state
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def _worker(rank: int, world: int, port: int, kind: str, args, queue) -> None:
    device = init_rank(rank, world, port, args.device, args.threads)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
    ddp, opt, source = _build(kind, _model(args).to(device), device, args)
    steps: list[float] = []
    phases = torch.zeros(len(PHASES), dtype=torch.float64)  # this process's CPU seconds in each

    def iteration() -> None:
        cpu = [time.process_time()]
        opt.zero_grad()
        cpu.append(time.process_time())
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        cpu.append(time.process_time())
        loss.backward()
        sync(device)
        cpu.append(time.process_time())
        t1 = time.perf_counter()
        opt.step()
        sync(device)
        steps.append(time.perf_counter() - t1)
        cpu.append(time.process_time())
        phases.add_(torch.tensor(cpu[1:], dtype=torch.float64) - torch.tensor(cpu[:-1], dtype=torch.float64))

    for _ in range(args.warmup):
        iteration()
    steps.clear()
    phases.zero_()
    wall, cpu = measure(iteration, device, args.steps)
    step = torch.tensor([statistics.median(steps)], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    state = torch.tensor([_state_bytes(kind, opt)], dtype=torch.float64)
    all_state = [torch.zeros_like(state) for _ in range(world)]
    dist.all_gather(all_state, state)
    all_phases = [torch.zeros_like(phases) for _ in range(world)]
    dist.all_gather(all_phases, phases / args.steps)
    small = _small_collective_cpu(world) if kind == "unsharded" else None
    if rank == 0:
        busiest = max(all_phases, key=lambda t: float(t.sum()))
        queue.put({"iter": wall, "cpu": cpu, "step": step.item(), "state": [int(s.item()) for s in all_state],
                   "source": source, "phases": busiest.tolist(), "small": small})
    close()


def _small_collective_cpu(world: int) -> float:
    """The busiest rank's CPU seconds for one all_gather of five ints on a gloo group of every rank:
    what DDP's desync check before a step costs (the non-finite check, where grads are not whole on
    every rank, one all-reduced scalar)."""
    group = dist.new_group(backend="gloo")
    mine = torch.zeros(5, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    for _ in range(10):
        dist.all_gather(everyone, mine, group=group)
    dist.barrier(group=group)
    start = time.process_time()
    for _ in range(SMALL_CALLS):
        dist.all_gather(everyone, mine, group=group)
    spent = torch.tensor([(time.process_time() - start) / SMALL_CALLS], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=group)
    return spent.item()


def _run(kind: str, world: int, args) -> dict:
    return spawn(_worker, world, kind, args)


def _memory_worker(rank: int, world: int, port: int, zero_stage: int, args, queue) -> None:
    """Rank 0's peak and the theory's terms (bytes) for ``kind`` (a ZeRO stage of ndweave)."""
    from ndweave.ddp.grad_shard import MAX_IN_FLIGHT
    from ndweave.mesh.testing.memory import TensorMemory
    from ndweave.optim import DistributedOptimizer

    device = init_rank(rank, world, port, args.device, args.threads)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
    with TensorMemory() as memory:
        ddp, _ = _ndweave_ddp(_model(args).to(device), device, args, zero_stage, args.memory_bucket_mb)
        opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-4})
        for step in range(3):
            if step == 1:  # the steps alone: Adam's state exists now, wrapping briefly held the params twice
                memory.reset_peak()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    buckets = ddp.grad_buckets()
    params, bucket = sum(b.numel for b in buckets) * 4, max(b.numel for b in buckets) * 4
    in_flight = min(MAX_IN_FLIGHT, len(buckets))
    theory = {"params": params, "grads": params // world if zero_stage == 2 else params,
              "state": opt.optimizer_state_bytes() + opt.master_param_bytes(),
              "buckets": min(in_flight + 1, len(buckets)) * bucket if zero_stage == 2 else 0,
              # autograd's grad of a param lives until DDP's hook has copied it into the bucket
              "one grad": max(p.numel() for p in ddp.parameters()) * 4}
    peak = torch.tensor([memory.peak_bytes(device.type)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"peak": int(peak.item()), "theory": theory})
    close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--memory-bucket-mb", type=float, default=1.0,
                        help="bucket size of the peak-memory runs: ZeRO-2 keeps a few buckets whole, so they must be "
                             "a small part of the model for its grads to shrink (4 MB is the default model's all)")
    args = parser.parse_args()
    params = sum(p.numel() for p in _model(args).parameters())
    print(f"MLP {args.layers}x{args.width}: {params / 1e6:.2f}M params, Adam, batch {args.batch}/rank, {args.device}")
    rows = []
    for world in args.world_sizes:
        rounds = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):  # interleaved, so drift in machine load hits every kind alike
            for kind in KINDS:
                rounds[kind].append(_run(kind, world, args))
        results = {kind: {**rs[0], **{k: statistics.median(r[k] for r in rs) for k in ("iter", "cpu", "step")}}
                   for kind, rs in rounds.items()}
        if results["ndweave"]["source"] != "ndweave.ddp":
            print("(ndweave-ddp not installed: ndweave rows use ndweave.mesh.testing.ReferenceDataParallel)")
        unsharded = results["unsharded"]["state"][0]
        ours = results["ndweave"]
        print(f"\nworld {world}")
        print(f"{'':16} {'iter ms':>9} {'ours/this':>9} {'CPU ms':>9} {'ours/this':>9} {'step ms':>9} {'ours/this':>9} "
              f"{'state MB/rank (max)':>20} {'x DP / unsharded':>17}")
        for kind in KINDS:
            r = results[kind]
            mb = max(r["state"]) / 2**20
            print(f"{kind:16} {r['iter'] * 1e3:9.2f} {ours['iter'] / r['iter']:9.2f} {r['cpu'] * 1e3:9.2f} "
                  f"{ours['cpu'] / r['cpu']:9.2f} {r['step'] * 1e3:9.2f} {ours['step'] / r['step']:9.2f} {mb:20.3f} "
                  f"{max(r['state']) * world / unsharded:17.3f}")
        print("\nbusiest rank's CPU ms by phase (one round; backward includes the grad reductions it starts)")
        print(f"{'':16} " + " ".join(f"{p:>9}" for p in PHASES))
        for kind in KINDS:
            print(f"{kind:16} " + " ".join(f"{v * 1e3:9.2f}" for v in rounds[kind][0]["phases"]))
        small = statistics.median(r["small"] for r in rounds["unsharded"])
        print(f"one all_gather of five ints on gloo (DDP's desync check before a step is one): "
              f"{small * 1e3:.2f} ms CPU on the busiest rank")
        memory = {stage: spawn(_memory_worker, world, stage, args) for stage in (1, 2)}
        print(f"\n{'peak MB/rank':16} {'measured':>9} {'theory':>9} {'ratio':>6}  terms (MB; "
              f"{args.memory_bucket_mb:g} MB buckets)")
        for stage, m in memory.items():
            bound = sum(m["theory"].values())
            terms = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in m["theory"].items())
            print(f"{'ZeRO-' + str(stage):16} {m['peak'] / 2**20:9.2f} {bound / 2**20:9.2f} "
                  f"{m['peak'] / bound:6.3f}  {terms}")
        zero = results["torch-zero"]
        ours_mb, zero_mb = max(ours["state"]) / 2**20, max(zero["state"]) / 2**20
        rows.append(Row("ndweave.optim DistributedOptimizer", f"ZeroRedundancyOptimizer(Adam) iteration, "
                        f"{params / 1e6:.2f}M-param MLP", world, ours["iter"] / zero["iter"], ours["cpu"] / zero["cpu"],
                        memory=f"state/rank {ours_mb:.2f} vs {zero_mb:.2f} MB",
                        bound=f"unsharded/DP = {unsharded / world / 2**20:.2f} MB: ours "
                              f"{max(ours['state']) * world / unsharded:.3f}x, torch's "
                              f"{max(zero['state']) * world / unsharded:.3f}x",
                        note=f"opt.step() alone {ours['step'] / zero['step']:.2f}x torch's; without ndweave's two "
                             f"checks CPU {results['ndweave-unchecked']['cpu'] / zero['cpu']:.2f}x (one small "
                             f"collective each: {small * 1e3:.2f} ms CPU)"))
        zero2, peaks = results["ndweave-zero2"], {s: m["peak"] / 2**20 for s, m in memory.items()}
        theory2 = sum(memory[2]["theory"].values()) / 2**20
        rows.append(Row("ndweave.optim DistributedOptimizer, DDP zero_stage=2", f"ZeroRedundancyOptimizer(Adam) "
                        f"iteration, {params / 1e6:.2f}M-param MLP", world, zero2["iter"] / zero["iter"],
                        zero2["cpu"] / zero["cpu"],
                        memory=f"peak/rank {peaks[2]:.2f} MB vs ZeRO-1's {peaks[1]:.2f} MB "
                               f"({args.memory_bucket_mb:g} MB buckets)",
                        bound=f"theory {theory2:.2f} MB: measured {peaks[2] / theory2:.3f}x",
                        note=f"opt.step() alone {zero2['step'] / zero['step']:.2f}x torch's"))
    emit(rows, args.json)

if __name__ == "__main__":
    main()
