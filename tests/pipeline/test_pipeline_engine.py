"""The engine's edges: the schedule picture, activations sent in ``p2p_dtype``, and clear errors for
batches that do not split or are missing where needed."""

from __future__ import annotations

import pytest
import torch

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import distributed
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage
from pipeline_models import TinyLM, batches, loss_fn


@distributed(world_size=4, timeout=120)
def test_timeline_shows_every_action_and_the_bubble():
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4)
    engine = PipeEngine(construct_pipeline_stage(TinyLM(num_layers=6), plan, mesh), mesh, loss_fn)
    (x, y), = batches(1, 8)
    engine(x, y)  # the first step also infers shapes: time the second
    engine.recorder.enabled = True
    engine(x, y)
    timeline = engine.timeline()
    text = timeline.text()
    print(text)
    rank = mesh["PP"].get_local_rank()
    assert [f"{a.kind}{a.micro_batch}" for a in timeline.ranks[rank] if a.kind == "F"] == ["F0", "F1", "F2", "F3"]
    assert [a.stage for a in timeline.ranks[rank]] == [rank] * 8
    assert text.count("rank 3 |") == 2 and "theory (p-1)/(v*m+p-1) = 0.429" in text
    assert 0.0 <= timeline.bubble_fraction < 1.0 and timeline.theory == pytest.approx(3 / 7)


@distributed(world_size=2, timeout=120)
def test_p2p_dtype_and_batch_errors():
    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="gpipe", num_microbatches=4, p2p_dtype=torch.float32)
    engine = PipeEngine(construct_pipeline_stage(TinyLM(num_layers=2), plan, mesh), mesh, loss_fn)
    (x, y), = batches(1, 8)
    first = mesh["PP"].get_local_rank() == 0
    if first:  # stage 0 sends float32; the last stage computes in float64 again
        assert engine.stages[0].submod(x[:2]).dtype == torch.float32
    else:
        assert engine.stages[0].submod(torch.randn(2, 4, 8, dtype=torch.float32)).dtype == torch.float64
    assert torch.isfinite(engine(x, y))
    with pytest.raises(ValueError, match="6 samples along dim 0.*num_microbatches=4"):
        engine(x[:6], y[:6])
    with pytest.raises(ValueError, match=f"holds the {'first' if first else 'last'} stage and needs"):
        engine(None, None)
