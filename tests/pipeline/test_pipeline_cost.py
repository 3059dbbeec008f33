"""``ndweave.pipeline.cost.stage_param_names``: which parameters each stage holds, from a model built on
meta with no process, equals the parameters of the chunks ``construct_pipeline_stage`` builds on every
PP rank: cut by registration order or traced, by split points or balanced, one stage per rank or
interleaved, with a weight tied across stages and a root-owned weight the forward reads."""

from __future__ import annotations

import pytest
import torch
from pipeline_any_models import AttrLM, TupleLM
from pipeline_models import SEQ, TinyLM

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import distributed
from ndweave.pipeline import PipelineParallelPlan, construct_pipeline_stage
from ndweave.pipeline.cost import stage_param_names
from ndweave.pipeline.plan import resolve_plan

MODELS = {"TinyLM": TinyLM, "AttrLM": AttrLM, "TupleLM": TupleLM}
# (model, traced, plan keywords): every case on PP=2
CASES = [
    ("TinyLM", False, {"schedule_type": "gpipe"}),
    ("TinyLM", True, {"schedule_type": "1f1b", "split_points": ["layers.4"]}),
    ("TinyLM", True, {"schedule_type": "interleaved_1f1b", "virtual_chunks": 2, "num_microbatches": 4}),
    ("AttrLM", True, {"schedule_type": "gpipe", "split_points": ["block3"]}),   # the root's `scale` on stage 1
    ("TupleLM", True, {"schedule_type": "gpipe"}),
]


def _example(traced: bool, device: str):
    return torch.zeros(2, SEQ, dtype=torch.long, device=device) if traced else None


@pytest.mark.parametrize("name,traced,kwargs", CASES, ids=[f"{c[0]}-{'traced' if c[1] else 'registration'}-{c[2]['schedule_type']}"
                                                          for c in CASES])
@distributed(world_size=2, timeout=60)
def test_predicted_stage_params_equal_the_built_chunks(name, traced, kwargs):
    plan = PipelineParallelPlan(**kwargs)
    with torch.device("meta"):
        predicted = stage_param_names(MODELS[name](), plan, 2, example_inputs=_example(traced, "meta"))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    module = construct_pipeline_stage(MODELS[name](), plan, mesh, example_inputs=_example(traced, "cpu"))
    rank = mesh.get_local_rank()
    mine = resolve_plan(plan, 2).stages_of(rank)
    assert [predicted[s] for s in mine] == [[n for n, _ in chunk.named_parameters()] for chunk in module.chunks]


def test_a_tied_weight_is_on_both_stages_and_every_other_on_one():
    with torch.device("meta"):
        model = TinyLM()
        names = stage_param_names(model, PipelineParallelPlan(schedule_type="gpipe"), 2,
                                  example_inputs=torch.zeros(2, SEQ, dtype=torch.long))
    assert "wte.weight" in names[0] and "head.weight" in names[1]   # one tensor, a copy per stage
    assert sorted(set(names[0]) | set(names[1])) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert not set(names[0]) & set(names[1])


def test_a_timed_split_needs_split_points():
    with pytest.raises(ValueError, match="split_method='time' times the layers on a device; give the plan split_points"):
        stage_param_names(TinyLM(), PipelineParallelPlan(split_method="time"), 2)
