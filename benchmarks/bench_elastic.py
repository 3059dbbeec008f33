"""Time from a killed rank to resumed training: the GPT job under ``torchrun --max-restarts 1``, one
rank SIGKILLed mid-training (``--kill-rank``), the restarted job resuming on its own from the newest
checkpoint (``--resume auto``). Not a timed test and not part of ``run_all.py``'s table (there is no
torch-native side to hold it against); run it directly:

    python benchmarks/bench_elastic.py                 # 4 CPU ranks, 2 rounds
    python benchmarks/bench_elastic.py --world 8 --mesh pp=2,dp=-1,tp=2

Each phase is timed by when the job's own lines reach this process (the kill line, torchrun's
"exitcode: -9", the restarted rank 0's mesh and "resumed from step" lines), so the figures are wall
time on this machine, load included; the cold start of the first attempt (launch to mesh) is shown
beside them, as most of a restart is starting the processes again.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

# (phase, the line that ends it): each phase starts where the previous one ended
MARKS = [("launch", "ParallelMesh("), ("kill", "SIGKILLs itself"), ("detected", "exitcode: -9"),
         ("restarted", "ParallelMesh("), ("resumed", "resumed from step")]


def one_round(args: argparse.Namespace) -> dict[str, float]:
    """Seconds from the launch to each mark of ``MARKS``, in one restarted run."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as checkpoints:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
                   "--max-restarts=1", "-m", "ndweave_gpt", "--mesh", args.mesh,
                   "--n-layer", "2", "--n-embd", "64", "--block-size", "32", "--steps", str(args.kill_at_step + 2),
                   "--checkpoint-every", str(args.checkpoint_every), "--checkpoint-dir", checkpoints, "--plot", "",
                   "--device", args.device, "--kill-rank", str(args.world - 1),
                   "--kill-at-step", str(args.kill_at_step)]
        begin, seen, pending = time.monotonic(), {}, list(MARKS)
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as job:
            for line in job.stdout:  # the progress bar's \r updates arrive with the next full line
                if pending and pending[0][1] in line:
                    seen[pending.pop(0)[0]] = time.monotonic() - begin
        if job.returncode or pending:
            raise SystemExit(f"the job exited with {job.returncode} before {[name for name, _ in pending]}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="ranks (torchrun --nproc-per-node)")
    parser.add_argument("--mesh", default="pp=2,dp=-1")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--kill-at-step", type=int, default=5, help="the last rank SIGKILLs itself as this step begins")
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rounds = [one_round(args) for _ in range(args.rounds)]
    print(f"GPT job on {args.world} ranks ({args.mesh}, {args.device}), last rank killed at step {args.kill_at_step}, "
          f"torchrun --max-restarts 1; median of {args.rounds} rounds, wall seconds")
    names = [name for name, _ in MARKS]
    for previous, name in zip(["start", *names], names):
        spans = [r[name] - (r[previous] if previous != "start" else 0.0) for r in rounds]
        print(f"  {previous:>9} -> {name:<9} {statistics.median(spans):6.2f} s")
    total = statistics.median(r["resumed"] - r["kill"] for r in rounds)
    cold = statistics.median(r["launch"] for r in rounds)
    print(f"kill -> resumed training: {total:.2f} s (a cold start, launch -> mesh, takes {cold:.2f} s here)")


if __name__ == "__main__":
    main()
