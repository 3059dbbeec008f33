"""The job with ``--compile`` (issue #41): each transformer block compiled by inductor once the plan is
applied, before DDP wraps it. At PP=2 x DP=2 (ZeRO-1, 1F1B) in float64 the compiled job's losses and
final parameters equal the eager job's to the strict tolerance, and rank 0 reports the step that
compiled apart from the others. TP and EP are refused for now, naming why."""

from __future__ import annotations

import pytest
import torch

from ndweave.mesh.testing import assert_close, run_distributed
from ndweave_gpt.metrics import say
from test_integration_gpt_job import TINY, _run
from test_integration_gpt_job import _resume_refused as _refused


def _run_and_report(argv: list[str]):
    """The job, and what rank 0 said about compiling (``say``'s lines)."""
    from ndweave_gpt import loop

    said: list[str] = []
    loop.say = said.append
    try:
        return _run(argv), said
    finally:
        loop.say = say


@pytest.mark.parity
def test_the_compiled_job_trains_as_the_eager_one(tmp_path):
    base = [*TINY, "--mesh", "pp=2,dp=2", "--steps", "3", "--checkpoint-dir", str(tmp_path), "--resume", "never"]
    eager = run_distributed(_run, 4, base, timeout=600)[0]
    shown = [a for a in base if a != "--quiet"]  # (rank 0 reports the compile where the run is not quiet)
    compiled, said = run_distributed(_run_and_report, 4, [*shown, "--compile"], timeout=900)[0]
    steps = sorted(eager.losses)
    assert_close(torch.tensor([compiled.losses[s] for s in steps], dtype=torch.float64),
                 torch.tensor([eager.losses[s] for s in steps], dtype=torch.float64), name="losses")
    for name, p in eager.params.items():
        assert_close(compiled.params[name], p, name=name)
    compiles = [line for line in said if line.startswith("compile:")]
    assert len(compiles) == 1 and compiles[0].startswith("compile: step 1 compiled") and "break" not in compiles[0], said


def test_compile_with_tensor_parallel_is_refused_for_now(tmp_path):
    messages = run_distributed(_refused, 2, [*TINY, "--mesh", "tp=2", "--compile", "--steps", "1",
                                             "--checkpoint-dir", str(tmp_path)], timeout=300)
    assert all("--compile with tp=2: not yet" in m for m in messages), messages
