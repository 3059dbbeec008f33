"""A clean exit every time: the 4-rank job of ``benchmarks/bench_exit.py`` (DDP + DistributedOptimizer,
8 steps, the parameters all-gathered, then 200 async all-reduces left in flight) launched under
torchrun 10 times in a row, ending with ``ndweave.mesh.shutdown()``: every launch exits 0. Ended with
``destroy_process_group()`` alone, the same job aborted at exit ("terminate called without an active
exception", SIGABRT) in most launches on this project's machine (see ``lifecycle.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from integration_models import ROOT


@pytest.mark.heavy
@pytest.mark.parametrize("runs", [2, pytest.param(10, marks=pytest.mark.slow)])  # (15 s a launch on 2 cores)
def test_launches_ending_with_shutdown_all_exit_0(runs):
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_exit.py"), "--runs", str(runs), "--in-flight", "200"]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert f"{runs} of {runs} runs of 4 ranks exited 0" in done.stdout and done.returncode == 0, done.stdout[-4000:]
