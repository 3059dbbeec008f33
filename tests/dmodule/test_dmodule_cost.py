"""``ndweave.dmodule.cost.local_param_shapes``: every parameter's local shape on a rank, predicted from a
model built on meta with no process group, equals what ``parallelize_module`` allocates on that rank:
zoo plans and ``"auto"`` at TP=2 (beside DP) and TP=4, sequence parallel, GPT-2's fused ``c_attn``
(``_StridedShard``) and uneven vocabulary (50257 rows), Mixtral's experts ``Shard(0)`` over EP with and
without TP; and ``parallelize_on_meta`` builds those shapes as meta DTensors that run forward and backward."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from dmodule_zoo_models import build  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from ndweave.dmodule import get_plan, parallelize_module  # noqa: E402
from ndweave.dmodule.cost import local_param_shapes, parallelize_on_meta  # noqa: E402
from ndweave.mesh import init_device_mesh  # noqa: E402
from ndweave.mesh.testing import distributed  # noqa: E402
from ndweave.mesh import fake_world


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=63, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"  # the one "auto" traces on meta (the grouped mm wants bf16 on CPU)
    return MixtralForCausalLM(config)


def _model(name: str) -> torch.nn.Module:
    return _mixtral() if name == "mixtral" else build(name)


# (model, plan, get_plan keywords, mesh dims): every case on a world of 4
CASES = [
    ("mlp", "mlp", {}, {"TP": 4}),
    ("nanogpt", "nanogpt", {"sequence_parallel": True}, {"DP": 2, "TP": 2}),
    ("nanogpt", "auto", {}, {"TP": 4}),
    ("hf_llama", "hf_llama", {}, {"TP": 4}),
    ("hf_llama", "auto", {"sequence_parallel": True}, {"DP": 2, "TP": 2}),
    ("hf_gpt2", "hf_gpt2", {}, {"TP": 4}),          # 50257 rows: 3 x 12565 + 12562; c_attn strided
    ("hf_gpt2", "auto", {}, {"DP": 2, "TP": 2}),
    ("mixtral", "hf_mixtral", {"expert_parallel": True}, {"EP": 2, "TP": 2}),
    ("mixtral", "hf_mixtral", {"expert_parallel": True}, {"DP": 2, "EP": 2}),  # no TP: all else whole
    ("mixtral", "auto", {"expert_parallel": True}, {"EP": 2, "TP": 2}),
]


def _predicted(name: str, plan_name: str, kwargs: dict, dims: dict[str, int], coordinate: dict[str, int]) -> dict:
    with torch.device("meta"):
        model = _model(name)
    return local_param_shapes(model, get_plan(plan_name, model, **kwargs), dims, coordinate)


@pytest.mark.parametrize("name,plan_name,kwargs,dims", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
@distributed(world_size=4, timeout=120)
def test_predicted_local_shapes_equal_what_parallelize_module_allocates(name, plan_name, kwargs, dims):
    torch.manual_seed(0)
    model = _model(name)
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    model = parallelize_module(model, mesh, get_plan(plan_name, model, **kwargs))
    coordinate = dict(zip(dims, mesh.get_coordinate()))

    got = {fqn: (p.to_local() if isinstance(p, DTensor) else p).shape for fqn, p in model.named_parameters()}
    assert _predicted(name, plan_name, kwargs, dims, coordinate) == got


def test_uneven_vocabulary_and_strided_fused_columns_on_every_coordinate():
    with torch.device("meta"):
        model = build("hf_gpt2")
    plan = get_plan("hf_gpt2", model)
    shapes = [local_param_shapes(model, plan, {"PP": 2, "TP": 4}, {"PP": 1, "TP": r}) for r in range(4)]
    assert [s["transformer.wte.weight"][0] for s in shapes] == [12565, 12565, 12565, 12562]  # torch chunks by ceil
    assert {s["transformer.h.0.attn.c_attn.weight"] for s in shapes} == {torch.Size([32, 24])}  # [q_r | k_r | v_r]
    assert sum(s["transformer.wte.weight"].numel() for s in shapes) == model.transformer.wte.weight.numel()


def test_a_coordinate_outside_the_mesh_and_experts_without_an_ep_dim_are_refused():
    with torch.device("meta"):
        model = _mixtral()
    with pytest.raises(ValueError, match=r"coordinate \{'TP': 2\} has 'TP' = 2; give an index in \[0, 2\)"):
        local_param_shapes(model, get_plan("hf_mixtral", model, expert_parallel=True), {"TP": 2}, {"TP": 2})
    with pytest.raises(ValueError, match=r"experts of 'model.layers.0.mlp.experts' over an 'EP' dim"):
        local_param_shapes(model, get_plan("hf_mixtral", model, expert_parallel=True), {"TP": 2}, {"TP": 0})


@pytest.mark.parametrize("name,plan_name,kwargs,dims", [CASES[1], CASES[4], CASES[7]], ids=["nanogpt", "llama", "mixtral"])
def test_a_meta_model_parallelized_on_meta_has_the_predicted_shapes_and_a_dense_one_runs(name, plan_name,
                                                                                     kwargs, dims):
    coordinate = {d: n - 1 for d, n in dims.items()}  # the last rank of the mesh
    rank = sum(c * math.prod(list(dims.values())[i + 1:]) for i, c in enumerate(coordinate.values()))
    with fake_world(math.prod(dims.values()), rank=rank):
        mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        with torch.device("meta"):
            model = _model(name)
        plan = get_plan(plan_name, model, **kwargs)
        with pytest.raises(ValueError, match="is on the meta device and has no values"):
            parallelize_module(model, mesh, plan)  # a model to train needs values
        model = parallelize_on_meta(model, mesh, plan)
        got = {fqn: (p.to_local() if isinstance(p, DTensor) else p).shape for fqn, p in model.named_parameters()}
        assert _predicted(name, plan_name, kwargs, dims, coordinate) == got
        assert all((p.to_local() if isinstance(p, DTensor) else p).is_meta for p in model.parameters())
        if name == "mixtral":
            return  # routing tokens to experts needs their values (bincount has no meta kernel)
        out = model(torch.zeros(2, 8, dtype=torch.long, device="meta"))
        logits = out[0] if isinstance(out, tuple) else out.logits
        logits.float().sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
