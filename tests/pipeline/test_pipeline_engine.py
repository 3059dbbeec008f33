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
    with pytest.raises(ValueError, match="refused on PP rank 0: it holds the first stage and needs inputs"):
        engine(None, None)


# ------------------------------------------------------------------ faults: one error on every PP rank, in seconds
def _engine(num_microbatches=4):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=num_microbatches)
    return PipeEngine(construct_pipeline_stage(TinyLM(num_layers=2), plan, mesh), mesh, loss_fn), mesh


@distributed(world_size=2, timeout=60)
def test_plan_that_differs_by_pp_rank_raises_on_every_rank():
    # construct_pipeline_stage is local; the engine is where the ranks meet (torch's schedule would wait)
    with pytest.raises(ValueError, match=r"PP rank 1 was given a plan with num_microbatches=2, PP rank 0 "
                                         r"num_microbatches=4; every PP rank must build the engine from the same"):
        _engine(num_microbatches=4 if torch.distributed.get_rank() == 0 else 2)


@distributed(world_size=2, timeout=60)
def test_batch_faults_on_one_pp_rank_raise_on_every_rank():
    torch.manual_seed(0)
    engine, mesh = _engine()
    (x, y), = batches(1, 12)
    first = mesh["PP"].get_local_rank() == 0
    # a batch the last stage alone refuses (6 does not split into 4): the first stage would wait for it
    with pytest.raises(ValueError, match=r"refused on PP rank 1: targets has 6 samples along dim 0"):
        engine(x[:8], y[:6])
    # targets of another mini-batch than the inputs: the loss would fail on the last stage alone
    with pytest.raises(ValueError, match=r"targets of shape \(4, 4\) \(last stage\) do not belong to inputs of shape \(8, 4\)"):
        engine(x[:8], y[:4])
    assert torch.isfinite(engine(x[:8], y[:8]))
    # a later step of another shape: torch's buffers were sized at the first step (gloo aborted the
    # receiving process, or a smaller batch was read silently into the old buffers)
    with pytest.raises(ValueError, match=r"inputs \(4, 4\), targets \(4, 4\), but the first step's had inputs "
                                         r"\(8, 4\), targets \(8, 4\).*drop_last=True"):
        engine(x[:4], y[:4])
    with pytest.raises(ValueError, match=r"inputs \(8, 4\), targets \(16, 4\), but the first step's"):
        engine(x[:8] if first else None, None if first else torch.cat([y[:8], y[:8]]))
    assert torch.isfinite(engine(x[:8], y[:8]))  # the engine still runs after refused steps


def test_engine_arguments_are_checked():
    from ndweave.mesh.testing import fake_world

    with fake_world(1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("PP",))
        module = construct_pipeline_stage(TinyLM(num_layers=2), PipelineParallelPlan(num_microbatches=1), mesh)
        with pytest.raises(TypeError, match="loss_fn must be a callable loss_fn"):
            PipeEngine(module, mesh, "cross_entropy")
        with pytest.raises(TypeError, match="plan must be a PipelineParallelPlan .* got dict"):
            PipeEngine(module, mesh, loss_fn, {"num_microbatches": 1})


def test_the_engines_stage_overrides_the_methods_torch_compat_pins():
    # torch's schedules call these PipelineStage methods with no documented contract: the ones the
    # engine overrides are listed (and their signatures pinned against torch) in torch_compat
    import inspect

    from torch.distributed.pipelining import PipelineStage

    from ndweave.mesh.torch_compat import PIPELINE_STAGE_OVERRIDES
    from ndweave.pipeline.engine import _Stage

    overridden = {name for name, value in vars(_Stage).items()
                  if inspect.isfunction(value) and not name.startswith("__") and hasattr(PipelineStage, name)}
    assert overridden == set(PIPELINE_STAGE_OVERRIDES)
    for name, params in PIPELINE_STAGE_OVERRIDES.items():
        assert tuple(inspect.signature(getattr(_Stage, name)).parameters)[1:] == params, name
