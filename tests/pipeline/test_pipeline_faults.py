"""A step that raises on one PP rank (a layer's forward, its backward, the loss) raises
``PipelineStageError`` on every PP rank within seconds, naming that rank, the part of the step and the
message, instead of leaving the others waiting in a receive until the process-group timeout."""

from __future__ import annotations

import re
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import distributed
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, PipelineStageError, construct_pipeline_stage
from pipeline_models import WIDTH, TinyLM, batches, loss_fn

RAISED_WITHIN_S = 10.0  # every rank; the process group's timeout in these tests is minutes


class Faulty(nn.Module):
    """A layer that works until told to fail: in its forward with a shape error (what a model the
    split did not fit raises), or in its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.fail_in: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_in == "forward":
            return self.fc(x.transpose(-1, -2))  # (batch, WIDTH, SEQ) into a Linear(WIDTH, ...)
        y = self.fc(x)
        return _FailingBackward.apply(y) if self.fail_in == "backward" else y


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise FloatingPointError("the backward of the faulty layer found a nan")


class FailingLoss:
    """``loss_fn`` that raises from its ``fail_at``-th call on (the last stage calls it)."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail_at: int | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise ValueError("a target is out of range")
        return loss_fn(logits, targets)


class Case(NamedTuple):
    """A pipeline in which one part of one step raises."""

    schedule: str
    virtual_chunks: int
    split_points: list[str]
    fails: str
    """``"forward"`` or ``"backward"`` of the faulty layer, or ``"loss"`` (on its 2nd micro-batch)."""
    faulty_layer: int | None
    fail_step: int
    failing_rank: int
    where: str
    message: str


SHAPE_ERROR = "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
NAN_IN_BACKWARD = "FloatingPointError: the backward of the faulty layer found a nan"
LOSS_ERROR = "ValueError: a target is out of range"
CUTS_2, CUTS_4, CUTS_8 = ["layers.3"], ["layers.1", "layers.3", "layers.5"], [f"layers.{i}" for i in range(1, 8)]

TWO_RANKS = {
    "gpipe-forward-at-shape-inference": Case(
        "gpipe", 1, CUTS_2, "forward", 4, 0, 1,
        "the forward of stage 1 (the first step's shape inference), in module layers.4.fc", SHAPE_ERROR),
    "1f1b-backward": Case("1f1b", 1, CUTS_2, "backward", 1, 1, 0, "the backward of micro-batch 0 on stage 0",
                          NAN_IN_BACKWARD),
    "interleaved-forward": Case("interleaved_1f1b", 2, CUTS_4, "forward", 3, 1, 0,
                                "the forward of micro-batch 0 on stage 2, in module layers.3.fc", SHAPE_ERROR),
    "zero-bubble-backward": Case("zero_bubble", 2, CUTS_4, "backward", 6, 1, 1,
                                 "the input-grad backward of micro-batch 0 on stage 3", NAN_IN_BACKWARD),
    "1f1b-loss": Case("1f1b", 1, CUTS_2, "loss", None, 1, 1, "loss_fn on micro-batch 1 (stage 1, the last)",
                      LOSS_ERROR),
}
FOUR_RANKS = {
    "1f1b-forward-middle": Case("1f1b", 1, CUTS_4, "forward", 4, 1, 2,
                                "the forward of micro-batch 0 on stage 2, in module layers.4.fc", SHAPE_ERROR),
    "gpipe-backward": Case("gpipe", 1, CUTS_4, "backward", 2, 1, 1, "the backward of micro-batch 0 on stage 1",
                           NAN_IN_BACKWARD),
    "interleaved-loss": Case("interleaved_1f1b", 2, CUTS_8, "loss", None, 1, 3,
                             "loss_fn on micro-batch 1 (stage 7, the last)", LOSS_ERROR),
}


def _fail_one_step(world_size: int, case: Case):
    """Train a TinyLM with ``case``'s faulty part until the step that raises; check this rank's error."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("PP",))
    torch.manual_seed(0)
    model = TinyLM(num_layers=8)
    faulty = Faulty()
    if case.faulty_layer is not None:
        model.layers[case.faulty_layer] = faulty
    loss = FailingLoss()
    plan = PipelineParallelPlan(schedule_type=case.schedule, num_microbatches=4, virtual_chunks=case.virtual_chunks,
                                split_points=case.split_points)
    engine = PipeEngine(construct_pipeline_stage(model, plan, mesh), mesh, loss, plan)
    for step, (x, y) in enumerate(batches(case.fail_step + 1, 8)):
        if step == case.fail_step and case.fails == "loss":  # on the last stage: its second micro-batch
            loss.fail_at = loss.calls + 2
        elif step == case.fail_step:  # only the rank holding the faulty layer is affected
            faulty.fail_in = case.fails
        start = time.monotonic()
        try:
            engine(x, y)
        except PipelineStageError as raised:
            error, seconds = raised, time.monotonic() - start
            break
    else:
        pytest.fail(f"no error on PP rank {dist.get_rank()}")
    assert step == case.fail_step
    print(f"PP rank {dist.get_rank()} raised {seconds:.3f} s after the step began")
    assert seconds < RAISED_WITHIN_S, f"PP rank {dist.get_rank()} raised after {seconds:.1f} s"
    assert (error.failure.pp_rank, error.failure.where) == (case.failing_rank, case.where), error.failure
    expected = f"failed on PP rank {case.failing_rank} (rank {case.failing_rank}), in {case.where}: {case.message}"
    assert expected in str(error), f"{expected!r} not in {str(error)!r}"
    cause = error.__cause__
    if dist.get_rank() == case.failing_rank:  # its own error is chained, its traceback kept as text
        assert f"{type(cause).__name__}: {cause}".startswith(case.message), repr(cause)
        raised_in = {"forward": "in forward", "backward": "in backward", "loss": "in __call__"}[case.fails]
        assert "test_pipeline_faults.py" in cause.__notes__[-1] and raised_in in cause.__notes__[-1], cause.__notes__
    else:  # the communication error that ended its wait
        assert re.search(r"Connection (closed|reset) by peer", str(cause)), repr(cause)
    return engine, mesh, (x, y)


@pytest.mark.parametrize("case", list(TWO_RANKS), ids=list(TWO_RANKS))
@distributed(world_size=2, timeout=90)
def test_a_step_that_raises_on_one_of_two_stages_raises_on_both(case):
    _fail_one_step(2, TWO_RANKS[case])


@pytest.mark.parametrize("case", list(FOUR_RANKS), ids=list(FOUR_RANKS))
@distributed(world_size=4, timeout=90)
def test_a_step_that_raises_on_one_of_four_stages_raises_on_all(case):
    _fail_one_step(4, FOUR_RANKS[case])


@distributed(world_size=2, timeout=90)
def test_after_a_failed_step_the_engine_refuses_and_a_new_engine_over_the_same_mesh_trains():
    engine, mesh, (x, y) = _fail_one_step(2, TWO_RANKS["1f1b-backward"])
    with pytest.raises(PipelineStageError, match=r"(?s)an earlier step failed on PP rank 0 .*build a new PipeEngine"):
        engine(x, y)
    with pytest.raises(PipelineStageError, match=r"an earlier step failed on PP rank 0"):
        engine.timeline()
    # the mesh's groups were left alone: new engines over the same mesh and chunks train
    for layer in engine.module.modules():
        if isinstance(layer, Faulty):
            layer.fail_in = None
    for _ in range(2):
        engine.module.zero_grad()
        engine = PipeEngine(engine.module, mesh, loss_fn, engine.resolved.plan)
        assert torch.isfinite(engine(x, y)) and torch.isfinite(engine(x, y))


def test_a_traceback_through_a_stage_shows_its_lines():
    """A stage runs its graph as generated Python: the frame shows the line that called the layer."""
    import traceback

    from ndweave.pipeline.cut import TracedCut

    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Faulty(), nn.Linear(WIDTH, WIDTH))
    x = torch.randn(2, WIDTH)
    cut = TracedCut(model, 2, PipelineParallelPlan(split_points=["1"]), (x,), "cpu")
    model[1].fail_in = "forward"
    with pytest.raises(RuntimeError) as raised:
        cut.programs[1].run(model, (x,))
    frames = [f for f in traceback.extract_tb(raised.value.__traceback__) if f.filename.startswith("<pipeline stage 1")]
    assert frames and "getattr(self, \"1\")" in frames[0].line.replace("'", '"'), frames
