"""Issue #38's faults, run as users run them: a 2-rank DDP job under torchrun, default timeouts, one rank
doing something the other does not. Each ends within 60 s of the training loop's start, on every rank
that is still there to say it, with an error naming rank 1 and what it did, and no rank is aborted by
gloo (SIGABRT, "collective mismatch") or left with its bare "Connection reset". A launch is bounded by
a subprocess timeout.

And in the test harness (``ndweave.mesh.testing``): a rank that raises between backward and step makes
the others raise an error naming it, and one that exits mid-step is named in the others' reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndweave.ddp import DDP, GradSyncDivergedError
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import DistributedTestError, run_distributed
from ndweave.optim import BasicOptimizer, DistributedOptimizer

BOUND_S = 60  # the bound, with the defaults

JOB = r'''
import contextlib, os, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from ndweave.ddp import DDP
from ndweave.mesh import init_device_mesh, shutdown
from ndweave.optim import BasicOptimizer, DistributedOptimizer

fault, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))  # the defaults: ndweave's timeouts, not the test's
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
model = DDP(model, mesh["DP"], bucket_size=32, use_distributed_optimizer=kind != "basic",
            zero_stage=2 if kind == "zero2" else None)
cls = BasicOptimizer if kind == "basic" else DistributedOptimizer
optimizer = cls(torch.optim.AdamW, [model], optimizer_kwargs={"lr": 0.01})
odd, start = rank == 1, time.monotonic()

def say(line):
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{time.monotonic() - start:.1f} {line}")

try:
    for step in range(4):
        x, y = torch.randn(4, 6), torch.randn(4, 3)
        optimizer.zero_grad()
        if fault == "skip_iteration" and odd and step == 1:
            continue  # an exception caught before the forward (a bad batch): the loop ends a step early
        if fault == "skip_step" and odd and step == 1:
            try:
                F.mse_loss(model(x), y).backward()
                raise ValueError("a bad batch")  # caught, and the loop goes on without its step
            except ValueError:
                continue
        if fault == "no_sync" and step == 1:
            for micro in range(2):  # rank 1 accumulates its first micro-batch, rank 0 syncs both
                with model.no_sync() if odd and micro == 0 else contextlib.nullcontext():
                    F.mse_loss(model(x), y).backward()
        else:
            F.mse_loss(model(x), y).backward()
        if fault == "exit" and odd and step == 2:
            os._exit(3)  # gone mid-step: between backward and step
        optimizer.step()
    if fault == "extra_step" and odd:
        optimizer.step()  # a 5th: rank 0 has left the loop
    shutdown(model)
    say("ok")
except BaseException as error:
    say(f"{type(error).__name__}: {error}")
    shutdown(abort=True)
    sys.exit(1)
'''


@pytest.mark.heavy  # a launched job each (torch imported three times: about 10 s)
@pytest.mark.parametrize("fault, kind, expected", [
    ("extra_step", "zero", r"rank 1 \(DP rank 1\) called step\(\) a 5th time.*ranks \[0\] had already called shutdown"),
    ("skip_step", "basic", r"rank 1 \(DP rank 1\) finishes grad sync #3.*rank 1 skipped a step\(\) DP rank 0 called"),
    ("skip_step", "zero", r"rank 1 \(DP rank 1\) finishes grad sync #3.*rank 1 skipped a step\(\) DP rank 0 called"),
    ("no_sync", "zero2", r"rank 1 entered no_sync\(\) for this backward, DP rank 0 did not: enter it on every rank"),
    ("no_sync", "zero", r"rank 1 entered no_sync\(\) for 1 backward\(s\) of this grad sync, DP rank 0 for 0"),
    ("skip_iteration", "zero", r"rank 0 \(DP rank 0\) finishes grad sync #4.*ranks \[1\] had already called shutdown"),
    ("exit", "basic", r"DP ranks \[1\] did not come to the DP ranks' check \(waited .*: they are gone"),
])
def test_a_fault_under_torchrun_ends_every_rank_with_the_rank_named(tmp_path: Path, fault, kind, expected):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(script), fault, kind, str(tmp_path)]
    done = subprocess.run(command, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    said = {r: (tmp_path / f"rank{r}").read_text() for r in (0, 1) if (tmp_path / f"rank{r}").exists()}
    log = done.stdout[-3000:]
    assert done.returncode != 0, log
    assert "SIGABRT" not in done.stdout and "terminate called" not in done.stdout, log
    if fault == "exit":  # rank 1 is gone without a word; rank 0 names it, unless torchrun stopped it first
        assert "exitcode  : 3" in done.stdout, log
        reports = [said[0]] if 0 in said else []
    else:
        assert set(said) == {0, 1}, (said, log)
        reports = list(said.values())
    for report in reports:  # "<seconds since the training loop began> <what the rank raised>"
        took, _, message = report.partition(" ")
        assert float(took) < BOUND_S and re.search(expected, message), (report, log)
        assert fault == "exit" or "Connection reset" not in message, (report, log)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- in the harness
def _warm() -> None:
    pass


def _raise_between_backward_and_step(kind: str) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    model = DDP(torch.nn.Linear(6, 3), mesh["DP"], bucket_size=32, use_distributed_optimizer=kind == "zero")
    optimizer = (DistributedOptimizer if kind == "zero" else BasicOptimizer)(torch.optim.SGD, [model],
                                                                             optimizer_kwargs={"lr": 0.1})
    F.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
    if dist.get_rank() == 1:
        raise ValueError("a bad batch on rank 1")
    # rank 0 waits in the step's parameter gathers (zero), or, its step making no collective (basic), at
    # the next grad sync: it learns of rank 1's error from the store there
    optimizer.step()
    F.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()


def _exit_between_backward_and_step() -> None:
    model = DDP(torch.nn.Linear(6, 3), init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))["DP"], bucket_size=32)
    optimizer = BasicOptimizer(torch.optim.SGD, [model], optimizer_kwargs={"lr": 0.1})
    F.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
    if dist.get_rank() == 1:
        os._exit(3)
    optimizer.step()  # (no collective: rank 0 finds rank 1 gone at the next grad sync)
    F.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()


@pytest.mark.parametrize("kind", ["basic", "zero"])
def test_in_the_harness_a_rank_that_raises_before_step_is_named_by_the_others(kind):
    run_distributed(_warm, 2)  # a started pool: time the failure, not the start
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_between_backward_and_step, 2, kind, timeout=60)
    assert time.monotonic() - start < 10
    first, second = info.value.failures
    assert (first.rank, first.kind) == (1, "raised") and "ValueError: a bad batch on rank 1" in first.detail
    # rank 0 raised its own error naming rank 1's (not stopped without a word)
    assert second.rank == 0 and second.kind == "raised", second.detail
    assert re.search(r"GradSyncDivergedError: rank 0 \(DP rank 0\) (called step\(\) a 1st time|finishes grad sync #2)"
                     r".*rank 1 failed: ValueError: a bad batch on rank 1", second.detail), second.detail
    assert second.detail.startswith("after rank 1 raised ValueError: a bad batch on rank 1")


def test_in_the_harness_a_rank_that_exits_mid_step_is_named_in_the_others_reports():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_between_backward_and_step, 2, timeout=60)
    failures = {f.rank: f for f in info.value.failures}
    assert failures[1].kind == "died" and "exited with code 3" in failures[1].detail
    assert failures[0].detail.startswith("after rank 1 died (the process exited with code 3)"), failures[0].detail
    if failures[0].kind == "raised":  # it saw the death itself: at the next sync's check, which names rank 1
        assert f"{GradSyncDivergedError.__name__}: rank 0" in failures[0].detail
        assert "DP ranks [1] did not come" in failures[0].detail
