"""The GPT job compiled (``--compile``: each block by inductor) against the same job eager.

    python benchmarks/bench_compile.py                   # pp=2,dp=2, the job's default GPT
    python benchmarks/bench_compile.py --quick

Each side is the job launched by torchrun (4 ranks) for ``--steps`` steps, eager first, then compiled,
alternating for ``--rounds`` rounds; a side's step is rank 0's median ``step_s`` (the job's ``--metrics``)
over the steps after the compiling one, and the compile is that step's time. Wall times of one rank:
the busiest rank's CPU time, the figure the other rows quote, needs the job to report it (not yet).
The compiled side runs where ``--compile`` runs today: pipeline and data parallel (issue #41).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Row, emit


def run_job(folder: Path, mesh: str, steps: int, compiled: bool) -> list[float]:
    """Rank 0's ``step_s`` of each step of one launch."""
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    shutil.rmtree(folder / "run", ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           "-m", "ndweave_gpt", "--mesh", mesh, "--steps", str(steps), "--quiet", "--plot", "",
                           "--metrics", str(metrics), "--checkpoint-dir", str(folder / "run"),
                           "--checkpoint-every", "0", *(["--compile"] if compiled else [])],
                          cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise SystemExit(f"the job failed:\n{done.stdout[-3000:]}")
    return [json.loads(line)["step_s"] for line in metrics.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="pp=2,dp=2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny: a smoke test")
    parser.add_argument("--json", metavar="PATH", default=None, help="append the result rows (run_all.py)")
    parser.add_argument("--device", default="cpu")  # (run_all.py passes these to every benchmark)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()
    if a.quick:
        a.steps, a.rounds = 4, 1
    folder = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    steady: dict[bool, list[float]] = {False: [], True: []}
    compiling: list[float] = []
    try:
        for _ in range(a.rounds):
            for compiled in (False, True):
                steps = run_job(folder, a.mesh, a.steps, compiled)
                if compiled:
                    compiling.append(steps[0])  # (no TP: no DModule, so the first step compiles)
                steady[compiled].append(statistics.median(steps[2:] or steps[1:]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    eager, compiled = (statistics.median(steady[k]) for k in (False, True))
    print(f"{a.mesh}: eager {eager * 1e3:.1f} ms/step, compiled {compiled * 1e3:.1f} ms/step "
          f"({compiled / eager:.2f}x), compiling step {statistics.median(compiling):.1f} s")
    emit([Row("ndweave job --compile", f"the same job eager, GPT {a.mesh}", 4, compiled / eager, float("nan"),
              note=f"rank 0 wall ms/step {compiled * 1e3:.1f} vs {eager * 1e3:.1f}; the compiling step "
                   f"{statistics.median(compiling):.1f} s")], a.json)


if __name__ == "__main__":
    main()
