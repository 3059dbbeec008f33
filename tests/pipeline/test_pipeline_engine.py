"""The engine's edges: the schedule picture, activations sent in ``p2p_dtype``, and clear errors for
batches that do not split or are missing where needed."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import assert_close, distributed
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage
from ndweave.pipeline.timeline import Action, ScheduleTimeline
from pipeline_models import TinyLM, batches, loss_fn

LOSS_S = 0.03


def _slow_loss(output, targets):
    time.sleep(LOSS_S)
    return loss_fn(output, targets)


@distributed(world_size=4, timeout=120)
def test_timeline_shows_every_action_and_the_bubble():
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4)
    engine = PipeEngine(construct_pipeline_stage(TinyLM(num_layers=6), plan, mesh), mesh, _slow_loss)
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
    # the loss is the last stage's forward's work, not a wait
    assert all(a.end - a.start >= LOSS_S for a in timeline.ranks[3] if a.kind == "F")


def test_the_bubble_is_each_ranks_wait_over_the_slowest_ranks_step():
    """1F1B on 2 ranks, one micro-batch, backward twice the forward: each rank works 3 of the step's 6
    units and waits the other half, the theory's (p - 1) / (m + p - 1); rank 1's own schedule ends 2
    units early, yet it waits for rank 0 all the same (the grad sync and the loss broadcast after the
    schedule)."""
    ranks = [[Action("F", 0, 0, 0.0, 1.0), Action("B", 0, 0, 4.0, 6.0)],
             [Action("F", 1, 0, 1.0, 2.0), Action("B", 1, 0, 2.0, 4.0)]]
    timeline = ScheduleTimeline(ranks, [6.0, 4.0], pp_size=2, num_microbatches=1, virtual_chunks=1, schedule="1F1B")
    assert timeline.bubble_fraction == pytest.approx(timeline.theory) == pytest.approx(0.5)


@distributed(world_size=2, timeout=120)
def test_stage_report_shows_each_stages_time_and_memory():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    (x, y), = batches(1, 8)
    peaks = {}
    for schedule, recompute in [("gpipe", False), ("1f1b", False), ("1f1b", True)]:
        # unbalanced on purpose: the embedding and five blocks, then one block, the norm and the head
        plan = PipelineParallelPlan(schedule_type=schedule, num_microbatches=4, split_points=["layers.5"],
                                    activation_recompute=recompute)
        module = construct_pipeline_stage(TinyLM(num_layers=6), plan, mesh)
        engine = PipeEngine(module, mesh, loss_fn)
        with pytest.raises(RuntimeError, match="no step recorded: set engine.recorder.enabled = True"):
            engine.stage_report()
        engine.recorder.enabled = True
        engine(x, y)
        report = engine.stage_report()
        print(report.text())
        first, last = report.stages
        assert [(s.stage, s.pp_rank) for s in report.stages] == [(0, 0), (1, 1)]
        assert all(s.forward_seconds > 0 and s.backward_seconds > 0 for s in report.stages) and report.imbalance >= 1
        mine = report.stages[mesh["PP"].get_local_rank()]
        assert mine.param_bytes == sum(p.numel() * 8 for p in module.parameters()) > 0
        assert first.param_bytes > 4 * last.param_bytes / 2  # five blocks and the embedding vs one block
        assert (first.sent_bytes, last.sent_bytes) == (4 * 2 * 4 * 8 * 8, 0)  # 4 micro-batches of (2, 4, 8) float64
        peaks[schedule, recompute] = first.peak_activation_bytes, last.peak_activation_bytes
        assert f"imbalance (slowest stage / mean): {report.imbalance:.2f}" in report.text()
    # GPipe holds all 4 micro-batches on both stages; 1F1B 2 on the first stage, 1 on the last
    (gpipe_first, gpipe_last), (first, last) = peaks["gpipe", False], peaks["1f1b", False]
    assert gpipe_first == 2 * first > 0 and gpipe_last == 4 * last > 0, peaks
    assert peaks["1f1b", True][0] < first / 4, peaks  # recomputed: only the chunk's inputs are kept


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


@distributed(world_size=2, timeout=120)
def test_a_loss_of_the_output_alone_needs_no_targets():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TinyLM(num_layers=2)
    (x, _), = batches(1, 8)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4)

    def mean_logit(output):  # veScale's tests put the loss in a function of the output alone
        return output.mean()

    engine = PipeEngine(construct_pipeline_stage(copy.deepcopy(model), plan, mesh), mesh, mean_logit)
    assert_close(engine(x), mean_logit(model(x)), name="loss without targets")
    with pytest.raises(ValueError, match=r"refused on PP rank 1: loss_fn takes the output alone .*targets were given"):
        engine(x, x)


# ------------------------------------------------------------------ faults: one error on every PP rank, in seconds
def _engine(num_microbatches=4):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=num_microbatches)
    return PipeEngine(construct_pipeline_stage(TinyLM(num_layers=2), plan, mesh), mesh, loss_fn), mesh


@distributed(world_size=2, timeout=60)
def test_plan_that_differs_by_pp_rank_raises_on_every_rank():
    # construct_pipeline_stage is local; the engine is where the ranks meet (torch's schedule would wait)
    with pytest.raises(ValueError, match=r"PipeEngine: rank 1 was given another plan than rank 0: 'num_microbatches' "
                                         r"is 4 on rank 0 but 2 on rank 1; every PP rank must build the engine from "
                                         r"the same PipelineParallelPlan"):
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
    from ndweave.mesh import fake_world

    with fake_world(1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("PP",))
        module = construct_pipeline_stage(TinyLM(num_layers=2), PipelineParallelPlan(num_microbatches=1), mesh)
        with pytest.raises(TypeError, match="loss_fn must be a callable loss_fn"):
            PipeEngine(module, mesh, "cross_entropy")
        with pytest.raises(TypeError, match="plan must be a PipelineParallelPlan .* got dict"):
            PipeEngine(module, mesh, loss_fn, {"num_microbatches": 1})


def test_the_engines_stage_overrides_the_methods_torch_compat_pins():
    # torch's schedules call these PipelineStage methods with no documented contract: the ones the
    # engine overrides (itself, or through torch_compat's PipelineStageBase: the private ones) are
    # listed (and their signatures pinned against torch) in torch_compat
    import inspect

    from torch.distributed.pipelining import PipelineStage

    from ndweave.mesh.torch_compat import PIPELINE_STAGE_OVERRIDES
    from ndweave.pipeline.stages import Stage

    ours = Stage.__mro__[:Stage.__mro__.index(PipelineStage)]  # Stage, PipelineStageBase
    overridden = {name for cls in ours for name, value in vars(cls).items()
                  if inspect.isfunction(value) and not name.startswith("__") and hasattr(PipelineStage, name)}
    assert overridden == set(PIPELINE_STAGE_OVERRIDES)
    for name, params in PIPELINE_STAGE_OVERRIDES.items():
        assert tuple(inspect.signature(getattr(Stage, name)).parameters)[1:] == params, name
