"""The job as users start it (``python -m ndweave_gpt``, ``torchrun -m ndweave_gpt``), where it decides
once and fails in one line:

* ``--mesh auto`` is planned by one process: on the harness's 2 ranks, each of which would choose another
  layout, only rank 0 plans and both get its layout; started directly under torchrun (the planner
  itself, over torchrun's store), the table is printed once and both ranks train the layout chosen;
* a failing job ends in one line naming the rank, what failed and the fix, exit code 1, and no launcher
  report unless ``--verbose``: a mesh the ranks refuse, a rank killed mid-run (``--kill-rank``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ndweave.mesh.testing import run_distributed
from ndweave_gpt import __main__ as job
from ndweave_gpt.config import parse_args

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--global-batch", "8",
        "--micro-batches", "2", "--warmup", "2", "--quiet", "--plot", "", "--metrics", "", "--steps", "1",
        "--checkpoint-every", "0"]
LAUNCHER_REPORT = ("ChildFailedError", "To enable traceback")


def _plan_with_this_ranks_measurement(argv: list[str]) -> tuple[list[str], int]:
    """``plan_once`` where each rank's own plan would differ (its memory or calibration, stood in for by
    the layout it would pick: rank 0 dp=2, rank 1 pp=2)."""
    import torch.distributed as dist

    rank, calls = dist.get_rank(), []

    def plan(config, argv):
        calls.append(rank)
        return [*argv, "--mesh", "dp=2" if rank == 0 else "pp=2"]

    return job.plan_once(parse_args(argv), argv, plan), len(calls)


def test_mesh_auto_is_planned_by_rank_zero_alone_and_every_rank_gets_its_layout(tmp_path):
    argv = ["--mesh", "auto", *TINY, "--checkpoint-dir", str(tmp_path)]
    (zero, planned_on_zero), (one, planned_on_one) = run_distributed(_plan_with_this_ranks_measurement, 2, argv,
                                                                     timeout=120)
    assert (planned_on_zero, planned_on_one) == (1, 0)
    assert zero == one and parse_args(one).parallel.mesh == "dp=2"


def _launch(*command: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=400, check=False)


def test_mesh_auto_under_torchrun_prints_one_table_and_runs_it_on_every_rank(tmp_path):
    done = _launch("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ndweave_gpt",
                   "--mesh", "auto", *TINY, "--checkpoint-dir", str(tmp_path / "ckpt"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("--mesh auto: 2 ranks") == 1 and done.stdout.count("<- chosen") == 1, done.stdout


@pytest.mark.parametrize("flags, rank, cause", [
    (["--mesh", "ep=2"], None,  # every rank refuses it: any of them may be first
     "--mesh ep=2 has ep=2, but the model has no experts to divide over it: add --moe-experts N"),
    (["--mesh", "dp=2", "--kill-rank", "1", "--kill-at-step", "1"], 1, "killed by SIGKILL; out of memory?"),
])
def test_a_failing_job_ends_in_one_line_naming_the_rank_and_the_fix(tmp_path, flags, rank, cause):
    done = _launch("-m", "ndweave_gpt", *TINY, *flags, "--checkpoint-dir", str(tmp_path / "ckpt"), cwd=tmp_path)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-4000:]
    assert last.startswith(f"error: rank {'' if rank is None else rank}") and cause in last, last
    assert not any(text in done.stderr for text in LAUNCHER_REPORT), done.stderr[-4000:]


def test_verbose_shows_the_launchers_report_then_the_line(tmp_path):
    done = _launch("-m", "ndweave_gpt", *TINY, "--mesh", "ep=2", "--verbose", "--checkpoint-dir",
                   str(tmp_path / "ckpt"), cwd=tmp_path)
    assert done.returncode == 1 and "ChildFailedError" in done.stderr, done.stderr[-4000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: rank ")
