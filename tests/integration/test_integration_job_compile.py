"""The job with ``--compile`` (issue #41): each transformer block compiled by inductor once the plan is
applied, before DDP wraps it. At PP=2 x DP=2 (ZeRO-1, 1F1B) in float64 the compiled job's losses and
final parameters equal the eager job's to the strict tolerance, and rank 0 reports the step that
compiled apart from the others. TP and EP are refused for now, naming why; the composition behind the
refusal is pinned by a strict xfail."""

from __future__ import annotations

import pytest
import torch

from ndweave.mesh.testing import assert_close, run_distributed
from ndweave.mesh.testing.pool import DistributedTestError
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


@pytest.mark.xfail(strict=True, raises=DistributedTestError, reason="issue #41: dynamo fails to fakeify the DTensor "
                   "parameters and grads that DDP and ZeRO lay into their flat buffers")
def test_compiled_tp_blocks_inside_ddp_and_zero_train():
    """What the job refuses for now, as a library user composes it: the GPT under DModule TP+SP, each
    block compiled, wrapped in ndweave's DDP with the DistributedOptimizer (ZeRO-1). Today the second
    step's compile fails ("set the storage of a tensor on device cpu to a storage on different device
    meta"): the grads published as DTensors over buffer views, and the parameters' shards re-pointed
    into ZeRO's buffer with ``set_``. This test turns green when that is fixed (then lift the refusal)."""
    try:
        run_distributed(_tp_ddp_zero_compiled, 2, timeout=600)
    except DistributedTestError as failed:  # that failure, not another
        assert "set the storage of a tensor on device" in str(failed), str(failed)[-3000:]
        raise


def _tp_ddp_zero_compiled() -> None:
    from ndweave.ddp import DDP
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan
    from ndweave.mesh import init_device_mesh
    from ndweave.optim import DistributedOptimizer
    from ndweave_gpt.models.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)).double()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("DP", "TP"))
    model = parallelize_module(model, mesh["TP"], get_plan("nanogpt", model, sequence_parallel=True))
    for block in model.transformer.h:
        block.compile()
    model = DDP(model, mesh["DP"], zero_stage=1)  # (as the job wraps each chunk)
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=[model], optimizer_kwargs={"lr": 1e-3})
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        _, loss = model(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
