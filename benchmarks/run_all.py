"""Run every benchmark in this folder, one after another, and print one table of their results
(``hatch run bench``).

    hatch run bench                         # CPU/gloo, world sizes 2 and 4
    hatch run bench --quick                 # tiny sizes and rounds: a smoke test of a minute or two
    hatch run bench --device cuda           # one GPU per rank, NCCL

Each benchmark prints its detailed figures as it goes and hands its result rows to this script
(``--json``); the table at the end has one row per component, comparison and world size. Only the
flags every benchmark takes are accepted here (and passed to each); for a benchmark's own flags
(model size, steps...) run it directly: ``python benchmarks/bench_ddp.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# (script, its own flags): the pipeline runs twice, the second time with a simulated device per rank
# (sleeping kernels), the only way to hold its bubble against the theory on a few shared cores
RUNS = [
    ("bench_ddp.py", []),
    ("bench_overlap.py", []),
    ("bench_dmodule.py", []),
    ("bench_dmodule_auto.py", []),
    ("bench_optim.py", []),
    ("bench_pipeline.py", []),
    ("bench_pipeline.py", ["--schedules", "gpipe", "1f1b", "interleaved_1f1b", "--simulate-ms", "10", "--width", "64",
                           "--batch", "16", "--steps", "1", "--rounds", "3", "--warmup", "1"]),
    ("bench_checkpoint.py", []),
    ("bench_experts.py", []),
    ("bench_context.py", []),
    ("bench_job.py", []),
    ("bench_data.py", []),
    ("bench_job.py", ["--compile"]),
]
# --quick: sizes and rounds small enough to show that everything runs, not to measure anything
QUICK = {
    "bench_ddp.py": ["--layers", "2", "--width", "256", "--steps", "2", "--rounds", "2", "--warmup", "1"],
    "bench_overlap.py": ["--layers", "4", "--width", "256", "--kernel-ms", "2", "--steps", "1", "--rounds", "1",
                         "--warmup", "1"],
    "bench_dmodule.py": ["--layers", "1", "--width", "64", "--tokens", "32", "--steps", "2", "--rounds", "2",
                         "--warmup", "1"],
    "bench_dmodule_auto.py": ["--layers", "1", "--width", "64", "--tokens", "16", "--steps", "2", "--rounds", "2",
                              "--warmup", "1", "--derive-rounds", "1"],
    "bench_optim.py": ["--layers", "2", "--width", "128", "--steps", "3", "--rounds", "1", "--warmup", "1"],
    "bench_pipeline.py": ["--layers", "8", "--width", "64", "--batch", "8", "--microbatches", "4",
                          "--schedules", "1f1b", "interleaved_1f1b", "--steps", "1", "--rounds", "2", "--warmup", "1"],
    "bench_checkpoint.py": ["--mb", "8", "--tensors", "4", "--rounds", "1", "--step-ms", "5", "--after", "1"],
    "bench_experts.py": ["--layers", "1", "--hidden", "32", "--tokens", "32", "--steps", "1", "--rounds", "1",
                         "--warmup", "1"],
    "bench_context.py": ["--seq", "256", "--layers", "1", "--width", "32", "--steps", "1", "--rounds", "1"],
    "bench_job.py": ["--quick"],
    "bench_data.py": ["--quick"],
}
COLUMNS = ("component", "vs (torch native)", "world", "wall ours/theirs", "CPU ours/theirs", "memory",
           "theoretical bound", "note")


def machine(device: str) -> str:
    """The machine in one line: CPU model, cores, torch, device, date."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device == "cuda" and torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name()})"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, device {device}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def load() -> str:
    """The 1-minute load average (at the start: what else was running; at the end: the run's own ranks too)."""
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = (f"`{r['component']}`", r["comparison"], str(r["world"]), f"{r['wall_ratio']:.2f}",
                 f"**{r['cpu_ratio']:.2f}**", r["memory"] or "—", r["bound"] or "—", r["note"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and rounds: a smoke test, not figures")
    args = parser.parse_args()
    header, load_before = f"Measured on: {machine(args.device)}", load()
    here = Path(__file__).resolve().parent
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "rows.jsonl"
        results.touch()
        common = ["--device", args.device, "--threads", str(args.threads),
                  "--world-sizes", *map(str, args.world_sizes), "--json", str(results)]
        for script, flags in RUNS:
            if args.quick:
                flags = QUICK[script] + (["--simulate-ms", "2"] if "--simulate-ms" in flags else [])
            print(f"\n=== {script} {' '.join(flags)} ===", flush=True)
            if subprocess.call([sys.executable, str(here / script), *common, *flags]) != 0:
                failed.append(script)
        rows = [json.loads(line) for line in results.read_text().splitlines()]
    print(f"\n{header}; load average {load_before} at the start, {load()} at the end\n")
    print(table(rows))
    print(f"\nRatios are ours / torch native: below 1 means ndweave is faster. **CPU** is the busiest rank's "
          f"process CPU time per step (median of interleaved rounds): the figure benchmarks/RESULTS.md quotes, because other "
          f"jobs sharing the machine stretch wall time (a rank waiting for a core) but not the CPU time a rank "
          f"spends. Wall time (median round, barrier to barrier) is shown next to it."
          + (" --quick: tiny sizes, not figures to quote." if args.quick else ""))
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
