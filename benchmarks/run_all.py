"""Run every benchmark in this folder, one after another (``hatch run bench``).

    hatch run bench                         # CPU/gloo, world sizes 2 and 4
    hatch run bench --device cuda           # one GPU per rank, NCCL

Only the flags every benchmark takes are accepted here (and passed to each); for a benchmark's own
flags (model size, steps...) run it directly: ``python benchmarks/bench_ddp.py --help``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()
    common = ["--device", args.device, "--threads", str(args.threads), "--world-sizes", *map(str, args.world_sizes)]
    here = Path(__file__).resolve().parent
    failed = []
    for script in sorted(here.glob("bench_*.py")):
        print(f"\n=== {script.name} ===", flush=True)
        if subprocess.call([sys.executable, str(script), *common]) != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
