"""Clean exits: consecutive launches of a small training job under torchrun, counted by exit code.
Not a timed benchmark and not part of ``run_all.py``'s table; run it directly:

    python benchmarks/bench_exit.py                          # 50 runs on 4 ranks, ending with shutdown()
    python benchmarks/bench_exit.py --end destroy            # the same job ending with destroy_process_group()
    python benchmarks/bench_exit.py --in-flight 200 --runs 10 --end destroy   # with async work still running

The job (``--worker``, one process per rank): a mesh over the ranks, DDP (``use_distributed_optimizer``)
and ``DistributedOptimizer`` (AdamW, clipping) on a small MLP, 8 steps, every rank's parameters
all-gathered, then ``--in-flight`` async all-reduces left un-waited (a job that ends with its work in
flight: an overlapped gather, a metrics reduction), then the end under test: ``ndweave.mesh.shutdown()``
or ``dist.destroy_process_group()`` alone. A run counts as clean when torchrun exits 0; an abort at
exit is a worker's SIGABRT (torchrun reports ``exitcode: -6``, "terminate called without an active
exception").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """One rank of the job (under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ndweave.ddp import DistributedDataParallel
    from ndweave.mesh import init_device_mesh, shutdown
    from ndweave.optim import DistributedOptimizer

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("DP",), timeout=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    model = DistributedDataParallel(model, mesh["DP"], use_distributed_optimizer=True, bucket_size=1000)
    optimizer = DistributedOptimizer(torch.optim.AdamW, [model], clip_grad=1.0, optimizer_kwargs={"lr": 1e-3})
    for _ in range(8):
        x, y = torch.randn(16, 32), torch.randn(16, 8)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: p.detach().clone() for name, p in model.named_parameters()})
    for _ in range(args.in_flight):
        dist.all_reduce(torch.ones(10_000), group=mesh.get_group("DP"), async_op=True)
    rank, begin = dist.get_rank(), time.perf_counter()
    if args.end == "shutdown":
        shutdown()
    else:
        dist.destroy_process_group()
    print(f"rank {rank}: {args.end} took {1000 * (time.perf_counter() - begin):.0f} ms", flush=True)


def launch(args: argparse.Namespace) -> tuple[int, float, str]:
    """One run: torchrun's exit code, its wall time, and the lines that say how a rank failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
                                         + [os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
               __file__, "--worker", "--end", args.end, "--in-flight", str(args.in_flight)]
    begin = time.monotonic()
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = done.stdout.splitlines()
    why = [line for line in lines if "terminate called" in line or "exitcode" in line]
    took = [line.rpartition("took ")[2] for line in lines if f"{args.end} took" in line]
    return done.returncode, time.monotonic() - begin, "; ".join(why[:3]) or f"{args.end}: {', '.join(took)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--world", type=int, default=4, help="ranks (torchrun --nproc-per-node)")
    parser.add_argument("--end", choices=["shutdown", "destroy"], default="shutdown")
    parser.add_argument("--in-flight", type=int, default=0, help="async all-reduces left running at the end")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    clean, seconds = 0, []
    for run in range(1, args.runs + 1):
        code, took, why = launch(args)
        clean += code == 0
        seconds.append(took)
        print(f"run {run}: exit {code} in {took:.1f} s  ({why})", flush=True)
    print(f"{clean} of {args.runs} runs of {args.world} ranks exited 0 (end: {args.end}, {args.in_flight} async "
          f"all-reduces in flight; median run {sorted(seconds)[len(seconds) // 2]:.1f} s)")
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
