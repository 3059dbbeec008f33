"""The job with a CP dim (``--mesh cp=...``): each sequence split over the CP ranks with causal load
balance, attention across them, grads averaged over DP x CP; in float64 every run equals the job on
one process (its losses each step and its final parameters), and what it cannot run yet is refused
on every rank with the fix."""

from __future__ import annotations

import pytest
import torch

from ndweave.mesh.testing import assert_close, run_distributed
from ndweave_gpt.config import parse_args
from ndweave_gpt.reference import train_single_device
from test_integration_gpt_job import TINY, _check, _check_params, _run


def _matches_one_process(flags: list[str], world: int, tmp_path, evaluate: bool = True) -> None:
    argv = [*TINY, *flags, "--steps", "2", "--eval-every", "2" if evaluate else "0", "--checkpoint-dir", str(tmp_path)]
    results = run_distributed(_run, world, argv, timeout=600)
    reference = train_single_device(parse_args(argv))
    for rank, result in enumerate(results):
        _check(result, reference, f"{flags}, rank {rank}")
        _check_params(result, reference, f"{flags}, rank {rank}")
        if not evaluate:
            continue
        assert sorted(result.val_losses) == sorted(reference.val_losses) == [2], result.val_losses
        assert_close(torch.tensor(result.val_losses[2], dtype=torch.float64),
                     torch.tensor(reference.val_losses[2], dtype=torch.float64), name="validation loss")


@pytest.mark.parity
@pytest.mark.parametrize("flags, world", [
    (["--mesh", "cp=2"], 2),
    (["--mesh", "pp=2,cp=2"], 4),
    (["--mesh", "dp=2,cp=2", "--model", "hf:llama", "--block-size", "32"], 4),
    pytest.param(["--mesh", "dp=2,cp=2,tp=2"], 8, marks=pytest.mark.heavy),
    (["--mesh", "cp=2,ep=2", "--moe-experts", "2"], 4),
    pytest.param(["--mesh", "cp=2,ep=2", "--model", "hf:mixtral", "--moe-experts", "4", "--moe-top-k", "2"], 4,
                 marks=pytest.mark.heavy),
    pytest.param(["--mesh", "dp=2,cp=2,ep=2", "--model", "hf:mixtral", "--moe-experts", "4", "--moe-top-k", "2"], 8,
                 marks=pytest.mark.slow),
])
def test_the_job_with_cp_trains_like_one_process(flags, world, tmp_path):
    _matches_one_process(flags, world, tmp_path)


@pytest.mark.parity
@pytest.mark.parametrize("model, mesh, world", [("gpt", "cp=2", 2), ("llama", "pp=2,cp=2", 4)])
def test_packed_documents_under_cp_train_like_one_process(model, mesh, world, tmp_path):
    """--data packed with documents kept apart: each CP rank takes its tokens' own (restarting) positions
    and its rows of the document mask, which spans the whole sequence's keys; the GPT, and a Llama
    folder with its tokenizer through two pipeline stages."""
    from test_integration_job_data import _jsonl, _llama, _texts

    data = [_jsonl(tmp_path / "train.jsonl", _texts(120))]
    if model == "llama":
        _llama(tmp_path / "llama")
        data += ["--init-from", str(tmp_path / "llama")]
    else:
        data += ["--packing", "documents"]
    _matches_one_process(["--data", *data, "--mesh", mesh], world, tmp_path, evaluate=False)


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "cp=2", "--block-size", "18"], "--block-size 18 must split into 2 x cp=4 chunks"),
])
def test_what_cp_cannot_run_yet_is_refused(flags, message, tmp_path):
    from ndweave_gpt.build import mesh_problem

    config = parse_args([*TINY, *flags, "--checkpoint-dir", str(tmp_path)])
    assert message in mesh_problem(config, {"PP": 1, "DP": 1, "CP": 2, "EP": 1, "TP": 1})


@pytest.mark.parity
def test_a_cp_checkpoint_resumes_at_cp4_and_on_one_process(tmp_path):
    """Parameters and optimizer state do not depend on CP: a CP=2 run's step-1 checkpoint resumes at
    CP=4 for step 2, whose checkpoint resumes on one process for step 3, each step as one process's."""
    base = [*TINY, "--steps", "3", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0"]
    uninterrupted = train_single_device(parse_args(base))
    first = run_distributed(_run, 2, [*base, "--mesh", "cp=2", "--stop-at", "1"], timeout=300)[0]
    second = run_distributed(_run, 4, [*base, "--mesh", "cp=4", "--resume", "--stop-at", "2"], timeout=300)[0]
    third = run_distributed(_run, 1, [*base, "--mesh", "dp=1", "--resume"], timeout=300)[0]
    assert (sorted(first.losses), sorted(second.losses), sorted(third.losses)) == ([1], [2], [3])
    for result, what in ((first, "CP=2"), (second, "resumed at CP=4"), (third, "resumed on one process")):
        _check(result, uninterrupted, what)
    _check_params(third, uninterrupted, "resumed on one process, step 3")


def test_sample_with_cp_is_written_on_one_process_after_the_run(tmp_path):
    """The pipeline's stages take a CP rank's position ids, which generation has not: rank 0 writes the
    sample from the final parameters, as with --data."""
    import os
    import subprocess
    import sys

    argv = [a for a in TINY if a != "--quiet"]
    done = subprocess.run([sys.executable, "-m", "ndweave_gpt", "--mesh", "cp=2", *argv, "--steps", "1", "--sample", "8",
                           "--checkpoint-dir", str(tmp_path / "ckpt")], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=400, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sample:" in done.stdout, done.stdout[-2000:]
