"""The plan layer on one process: schedule names and their micro-batch needs, layers and split points,
chunks that keep original FQNs (also from a meta-device model), and the errors users meet."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS

from ndweave.mesh import init_device_mesh
from ndweave.mesh.contracts import removed_modules
from ndweave.mesh import fake_world
from ndweave.pipeline import (
    PipelineParallelPlan,
    SharedParam,
    StagePlaceholder,
    construct_pipeline_stage,
    model_layers,
)
from ndweave.pipeline.plan import resolve_plan, schedule_class
from pipeline_models import TinyLM


def _stage(model: nn.Module, plan: PipelineParallelPlan, pp: int, rank: int):
    with fake_world(pp, rank=rank):
        return construct_pipeline_stage(model, plan, init_device_mesh("cpu", (pp,), mesh_dim_names=("PP",)))


def test_schedule_names_ours_and_torchs():
    assert schedule_class("1f1b") is Schedule1F1B
    assert schedule_class("zero_bubble") is ScheduleInterleavedZeroBubble
    assert schedule_class("ScheduleLoopedBFS") is ScheduleLoopedBFS and schedule_class("loopedbfs") is ScheduleLoopedBFS
    with pytest.raises(ValueError, match="unknown schedule_type 'pipedream'.*1f1b"):
        PipelineParallelPlan(schedule_type="pipedream")


def test_micro_batch_and_stage_count_errors_name_the_fix():
    with pytest.raises(ValueError, match="needs num_microbatches >= 4.*got 2"):
        resolve_plan(PipelineParallelPlan(schedule_type="1f1b", num_microbatches=2), pp_size=4)
    resolve_plan(PipelineParallelPlan(schedule_type="gpipe", num_microbatches=2), pp_size=4)  # GPipe runs any
    with pytest.raises(ValueError, match="nearby values that do"):
        resolve_plan(PipelineParallelPlan(schedule_type="interleaved_1f1b", virtual_chunks=2, num_microbatches=5), 2)
    with pytest.raises(ValueError, match="one stage per rank.*interleaved_1f1b"):
        resolve_plan(PipelineParallelPlan(schedule_type="gpipe", virtual_chunks=2), pp_size=2)
    with pytest.raises(ValueError, match="num_stages=3 but PP size 2"):
        resolve_plan(PipelineParallelPlan(num_stages=3), pp_size=2)
    assert resolve_plan(PipelineParallelPlan(), pp_size=4).num_microbatches == 4  # default: the stage count


def test_layers_and_balanced_split():
    model = TinyLM(num_layers=4, tie=False)
    assert model_layers(model) == ["wte", "drop", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]
    first, last = (_stage(model, PipelineParallelPlan(), 2, r) for r in (0, 1))
    assert first.stage_layers == last.stage_layers
    sizes = [sum(model.get_submodule(f).weight.numel() if f in ("wte", "head") else
                 sum(p.numel() for p in model.get_submodule(f).parameters()) for f in layers)
             for layers in first.stage_layers]
    assert first.stage_layers[0][:3] == ["wte", "drop", "layers.0"] and abs(sizes[0] - sizes[1]) < 0.3 * sum(sizes)


def test_chunks_keep_original_fqns_and_hold_only_their_layers():
    model = TinyLM(num_layers=4)
    plan = PipelineParallelPlan(split_points=["layers.1", "layers.3"], schedule_type="gpipe")
    stages = [_stage(model, plan, 3, r) for r in range(3)]
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    assert names[0] == ["wte.weight", *(f"layers.0.{p}" for p in ("norm.weight", "norm.bias", "fc.weight", "fc.bias", "proj.weight", "proj.bias"))]
    assert all(n.startswith("layers.1.") or n.startswith("layers.2.") for n in names[1])
    assert names[2][-3:] == ["norm.weight", "norm.bias", "head.weight"]
    # shared tensors with the model, no copies; removed layers are placeholders, the model is untouched
    assert stages[2][0].head.weight is model.head.weight and isinstance(stages[2][0].wte, StagePlaceholder)
    assert isinstance(model.wte, nn.Embedding) and isinstance(stages[1][0].layers[0], StagePlaceholder)
    assert removed_modules(stages[1][0])["layers.0.fc"] == "Linear" and "drop" not in removed_modules(stages[1][0])
    # the tied embedding / head is one weight on the first and last stage
    assert stages[0].shared_params == [SharedParam(("wte.weight", "head.weight"), (0, 2))]
    assert set(stages[1].state_dict()) == {f"layers.{i}.{p}" for i in (1, 2) for p in
                                           ("norm.weight", "norm.bias", "fc.weight", "fc.bias", "proj.weight", "proj.bias")}


def test_meta_model_materializes_only_its_stage_and_loads_by_original_fqn():
    torch.manual_seed(0)
    reference = TinyLM(num_layers=4)
    with torch.device("meta"):
        model = TinyLM(num_layers=4)
    stage = _stage(model, PipelineParallelPlan(split_points=["layers.2"]), 2, 1)
    stage[0].to_empty(device="cpu")
    stage.load_state_dict(reference.state_dict())  # a whole-model checkpoint: other stages' keys ignored
    for name, param in stage.named_parameters():
        assert torch.equal(param, reference.get_parameter(name)), name
    others = [p for n, p in model.named_parameters() if n.startswith(("wte.", "layers.0.", "layers.1."))]
    assert others and all(p.is_meta for p in others)  # other stages' layers were never allocated
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(stage[0](x), reference.head(reference.norm(reference.layers[3](reference.layers[2](x)))))


def test_split_point_errors_list_nearest_fqns():
    model = TinyLM(num_layers=4)
    with pytest.raises(ValueError, match=r"'layer.2' names no module.*'layers.2'"):
        _stage(model, PipelineParallelPlan(split_points=["layer.2"]), 2, 0)
    with pytest.raises(ValueError, match="inside the layer 'layers.2'"):
        _stage(model, PipelineParallelPlan(split_points=["layers.2.fc"]), 2, 0)
    with pytest.raises(ValueError, match="need 1 split points"):
        _stage(model, PipelineParallelPlan(split_points=["layers.1", "layers.2"]), 2, 0)
    with pytest.raises(ValueError, match="shared_modules names 'lm_head'.*'head'"):
        _stage(model, PipelineParallelPlan(shared_modules=[["wte", "lm_head"]]), 2, 0)


def test_shared_modules_tie_weights_the_model_does_not():
    model = TinyLM(num_layers=2, tie=False)
    stage = _stage(model, PipelineParallelPlan(shared_modules=[["wte", "head"]]), 2, 0)
    assert stage.shared_params == [SharedParam(("wte.weight", "head.weight"), (0, 1))]
    # the first stage's name comes first whatever the plan's order (checkpoints key the state by it)
    stage = _stage(model, PipelineParallelPlan(shared_modules=[["head", "wte"]]), 2, 0)
    assert stage.shared_params == [SharedParam(("wte.weight", "head.weight"), (0, 1))]


def test_stage_input_name_is_gone_for_traced_stage_io():
    """One way to say what crosses a cut: ``example_inputs=`` (traced, ``StageIO``); the keyword
    deprecated in 0.7 is removed."""
    with pytest.raises(TypeError, match="stage_input_name"):
        PipelineParallelPlan(split_points=["layers.1"], stage_input_name="inputs_embeds")
