"""Fault tolerance of the main job under torch's own launcher (``torchrun``, CPU/gloo), against the
same run on one process in float64, strict:

* a rank SIGKILLed inside a checkpoint save of a 4-rank run with ``--max-restarts 1``: torchrun
  restarts the workers, the job resumes on its own from the checkpoint before (the one being written
  is never used), redoes the steps since, and finishes;
* grow and shrink: a 2-rank run killed mid-training (no restarts left) continues on 4 ranks, then on
  2 again, each time from the newest checkpoint, ``--mesh pp=2,dp=-1`` resolving DP for the world.
* a rank SIGKILLed with no restart left: the launch fails within seconds, naming that rank as the
  root cause, with no worker left running (and none aborted).

Each part's loss curve (the whole history the final checkpoint keeps: steps of every attempt) and the
final parameters equal the uninterrupted single-process run's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from ndweave.checkpoint import CheckpointManager
from ndweave.mesh.testing import assert_close
from ndweave_gpt.build import build_model
from ndweave_gpt.config import parse_args
from ndweave_gpt.reference import train_single_device

STEPS = 6
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--global-batch", "8",
        "--micro-batches", "2", "--warmup", "2", "--lr", "1e-2", "--min-lr", "1e-3", "--clip", "0.5",
        "--dtype", "float64", "--plot", "", "--metrics", "", "--steps", str(STEPS), "--checkpoint-every", "2",
        "--mesh", "pp=2,dp=-1"]


def _torchrun(nproc: int, checkpoints, *flags: str, restarts: int = 0) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={restarts}", "-m", "ndweave_gpt", *TINY,
               "--checkpoint-dir", str(checkpoints), *flags]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return done.returncode, done.stdout


def _check_against_one_process(checkpoints) -> None:
    """The newest checkpoint's loss history (every step since the run began) and model, loaded on
    this process, against the uninterrupted single-process run."""
    args = parse_args([*TINY, "--quiet"])
    reference = train_single_device(args)
    model = build_model(args)
    state = {"model": model, "loss_history": []}  # the job keeps it as a list (a resume may extend it)
    assert CheckpointManager(checkpoints).load_latest(state, strict=False) == STEPS
    expected = [reference.losses[s] for s in range(1, STEPS + 1)]
    assert_close(torch.tensor(state["loss_history"], dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                 name="loss history")
    for name, p in model.named_parameters():
        assert_close(p.detach(), reference.params[name], name=name)


@pytest.mark.parity
@pytest.mark.heavy
def test_a_rank_killed_in_a_checkpoint_save_restarts_from_the_one_before(tmp_path):
    code, out = _torchrun(4, tmp_path, "--kill-rank", "1", "--kill-at-step", "4", "--kill-in-save", restarts=1)
    assert code == 0, out[-4000:]
    assert "rank 1 SIGKILLs itself at step 4 inside its checkpoint save" in out, out[-4000:]
    assert "resumed from step 2 of" in out and "(torchrun restart 1, 4 ranks)" in out, out[-4000:]
    assert "done: mesh PP=2 x DP=2 x TP=1, steps 3..6" in out, out[-4000:]
    _check_against_one_process(tmp_path)


@pytest.mark.parity
@pytest.mark.heavy
def test_a_killed_run_continues_on_more_ranks_then_on_fewer(tmp_path):
    code, out = _torchrun(2, tmp_path, "--kill-rank", "1", "--kill-at-step", "4")
    assert code != 0 and "rank 1 SIGKILLs itself at step 4 as it begins" in out, out[-4000:]
    assert CheckpointManager(tmp_path).steps() == [2]

    code, out = _torchrun(4, tmp_path, "--resume", "--stop-at", "4")  # grow 2 -> 4
    assert code == 0 and "resumed from step 2" in out and "mesh PP=2 x DP=2 x TP=1, steps 3..4" in out, out[-4000:]

    code, out = _torchrun(2, tmp_path, "--resume")  # shrink 4 -> 2
    assert code == 0 and "resumed from step 4" in out and "mesh PP=2 x DP=1 x TP=1, steps 5..6" in out, out[-4000:]
    _check_against_one_process(tmp_path)


@pytest.mark.heavy
def test_a_killed_rank_without_restarts_is_named_and_no_worker_is_left(tmp_path):
    started = time.monotonic()
    code, out = _torchrun(4, tmp_path, "--kill-rank", "1", "--kill-at-step", "3")  # step 3: no save
    took = time.monotonic() - started
    # torchrun notices the death and stops the others at once (a survivor left alone waits out --timeout)
    assert code != 0 and took < 120, (code, took, out[-4000:])
    assert "rank 1 SIGKILLs itself at step 3 as it begins" in out, out[-4000:]
    root = out[out.index("Root Cause (first observed failure):"):]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9 .*\(SIGKILL\)", root), out[-4000:]
    # the survivors were stopped by torchrun (SIGTERM), none aborted (gloo on a dead peer) or failed on its own
    others = out[out.index("Failures:"):out.index("Root Cause")]
    assert re.findall(r"exitcode\s*: (-?\d+)", others) == ["-15"] * 3, out[-4000:]
    workers = set(re.findall(r"\(pid: (\d+)\)", root + others))
    assert len(workers) == 4 and not [pid for pid in workers if _is_worker(pid)], out[-4000:]


def _is_worker(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"ndweave_gpt" in cmdline.read()
    except OSError:  # gone (or no /proc)
        return False
