"""``ndweave.pipeline.cost.stage_param_names``: which parameters each stage holds, from a model built on
meta with no process, equals the parameters of the chunks ``construct_pipeline_stage`` builds on every
PP rank: cut by registration order or traced, by split points or balanced, one stage per rank or
interleaved, with a weight tied across stages and a root-owned weight the forward reads."""

from __future__ import annotations

import contextlib

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


def _gpt():
    """``examples/gpt/model.py``'s GPT (the job's model), small: 4 blocks, width 32, vocabulary 256."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "ndweave_examples_gpt_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "examples/gpt/model.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    gpt = sys.modules[name]
    return gpt.GPT(gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32, dropout=0.0))


MICRO_BATCH, BLOCK = 2, 32


def _measured_peaks(plan: PipelineParallelPlan, kernels) -> list[int]:
    """``engine.stage_report()``'s peak activation bytes per stage after one step of the GPT on PP=2."""
    import torch.nn.functional as F

    from ndweave.pipeline import PipeEngine

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    module = construct_pipeline_stage(_gpt(), plan, mesh, example_inputs=torch.zeros(1, BLOCK, dtype=torch.long))
    engine = PipeEngine(module, mesh, lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()), plan)
    engine.recorder.enabled = True
    ids = torch.randint(0, 256, (4 * MICRO_BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    with kernels:
        engine(ids[:, :-1], ids[:, 1:])
    return [s.peak_activation_bytes for s in engine.stage_report().stages]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@distributed(world_size=2, timeout=90)
def test_predicted_activations_in_flight_against_the_measured_peak_of_the_gpt_job_model(schedule):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ndweave.pipeline.cost import microbatches_in_flight, saved_bytes_by_stage

    plan = PipelineParallelPlan(schedule_type=schedule, num_microbatches=4)
    with torch.device("meta"):
        saved = saved_bytes_by_stage(_gpt(), plan, 2, torch.zeros(MICRO_BATCH, BLOCK, dtype=torch.long))
    resolved = resolve_plan(plan, 2)
    predicted = [saved[s] * microbatches_in_flight(resolved, s) for s in range(2)]
    assert [microbatches_in_flight(resolved, s) for s in range(2)] == ([4, 4] if schedule == "gpipe" else [2, 1])

    # the kernels meta runs (attention by its math path, which keeps the T x T weights): exact
    # (the first stage's ids are views of the whole batch, ids[:, :-1], whose storage the meter counts)
    batch_storage = (4 * MICRO_BATCH) * (BLOCK + 1) * 8 - MICRO_BATCH * BLOCK * 8
    math = _measured_peaks(plan, sdpa_kernel(SDPBackend.MATH))
    held = microbatches_in_flight(resolved, 0)
    assert [predicted[0] + held * batch_storage, predicted[1]] == math, (predicted, math)
    # CPU's own attention kernel keeps less (its log-sum-exp, not the weights): an over-estimate
    measured = _measured_peaks(plan, contextlib.nullcontext())
    assert all(1.0 <= p / m <= 1.3 for p, m in zip(predicted, measured)), (predicted, measured)
    print(f"{schedule}: predicted {predicted}, measured {measured} bytes (CPU kernels)")
