"""Plan zoo bookkeeping, in one process: names, plan contents per model config, JSON round trips."""

import io
import json

import pytest
from dmodule_zoo_models import build
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from ndweave.mesh.torch_compat import StridedShard as _StridedShard

from ndweave.dmodule import PlacementSpec
from ndweave.dmodule.patches import patch_name, registered_patches, resolve_patch
from ndweave.dmodule.plans import get_plan, list_plans, load_plan, save_plan
from ndweave.dmodule.plans.serialization import encode_plan
from ndweave.dmodule.spec import normalize_plan

ALL = [(name, sp) for name in ["mlp", "nanogpt", "hf_llama", "hf_gpt2"] for sp in (False, True)]


def test_list_plans_names_the_zoo():
    assert list_plans() == ["auto", "hf_deepseek_v3", "hf_gpt2", "hf_llama", "hf_mixtral", "hf_qwen2_moe", "hf_qwen3_moe",
                            "mlp", "nanogpt"]


@pytest.mark.parametrize("name", ["hf_mixtral", "hf_qwen2_moe", "hf_qwen3_moe", "hf_deepseek_v3"])
def test_every_moe_plan_is_valid_data_that_saves_and_loads(name, tmp_path):
    plan = get_plan(name, expert_parallel=True)
    normalize_plan(plan, None, None, None)
    assert plan["patch"][r"model.layers.\d+.mlp.experts"] == ["expert_parallel"]
    assert "expert_parallel" in registered_patches()
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan


def test_unknown_plan_lists_the_known_ones():
    with pytest.raises(KeyError, match="no plan named 'llama'.*'hf_llama'"):
        get_plan("llama")


@pytest.mark.parametrize("name,sequence_parallel", ALL)
def test_every_plan_is_valid_data(name, sequence_parallel):
    plan = get_plan(name, sequence_parallel=sequence_parallel)
    normalize_plan(plan, None, None, None)  # the core accepts every value
    for key, patches in plan.get("patch", {}).items():
        # a registered name, bare or with JSON arguments the patch takes
        assert all(not callable(p) and patch_name(p) in registered_patches() for p in patches)
        for p in patches:
            resolve_patch(p, f"patch[{key!r}]")
    assert get_plan(name, sequence_parallel=sequence_parallel) is not plan  # fresh: safe to edit


@pytest.mark.parametrize("name,sequence_parallel", ALL)
def test_save_then_load_gives_the_same_plan(name, sequence_parallel, tmp_path):
    plan = get_plan(name, sequence_parallel=sequence_parallel)
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert encode_plan(loaded) == encode_plan(plan)
    assert loaded == plan  # placements and PlacementSpec compare by value
    f = io.StringIO()
    save_plan(plan, f)
    f.seek(0)
    assert load_plan(f) == plan


def test_json_encoding_is_the_documented_one():
    text = """{
      "parameter": {"fc1.weight": [{"Shard": 0}], "fc2.bias": ["Replicate"], "qkv.weight": [{"StridedShard": [1, 3]}]},
      "forward": {
        "fc1.input": [["Replicate"], null],
        "attn.input": {"hidden_states": [{"Shard": 1}]},
        "fc2.output": [{"PlacementSpec": {"placements": [{"Shard": -1}], "to_local": true,
                                           "grad_placements": [{"Partial": "sum"}], "async_op": true}}]
      },
      "patch": {"emb": "vocab_parallel_embedding"}
    }"""
    plan = load_plan(io.StringIO(text))
    assert plan["parameter"] == {"fc1.weight": [Shard(0)], "fc2.bias": [Replicate()],
                                 "qkv.weight": [_StridedShard(1, split_factor=3)]}
    assert plan["forward"]["fc1.input"] == [[Replicate()], None]
    assert plan["forward"]["attn.input"] == {"hidden_states": [Shard(1)]}
    assert plan["forward"]["fc2.output"] == [
        PlacementSpec([Shard(-1)], to_local=True, grad_placements=[Partial()], async_op=True)
    ]
    assert plan["patch"] == {"emb": ["vocab_parallel_embedding"]}


def test_saved_plans_have_one_entry_per_line(tmp_path):
    save_plan(get_plan("mlp"), tmp_path / "mlp.json")
    lines = (tmp_path / "mlp.json").read_text().splitlines()
    assert '    "fc1.weight": [{"Shard": 0}],' in lines
    assert json.loads((tmp_path / "mlp.json").read_text())["ndweave_plan_format"] == 1


def test_a_callable_patch_cannot_be_saved():
    plan = {"patch": {"fc1": [lambda module, mesh, fqn: None]}}
    with pytest.raises(TypeError, match="register it with ndweave.dmodule.register_patch"):
        save_plan(plan, io.StringIO())


def test_load_refuses_unknown_sections():
    with pytest.raises(ValueError, match="not \\['params'\\]"):
        load_plan(io.StringIO('{"params": {}}'))


def test_mlp_plan_follows_the_model_biases():
    class NoBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)

    assert set(get_plan("mlp", NoBias())["parameter"]) == {"fc1.weight", "fc2.weight"}
    with pytest.raises(ValueError, match="no nn.Linear 'fc1'"):
        get_plan("mlp", nn.Linear(2, 2))


def test_nanogpt_plan_reads_the_config():
    plan = get_plan("nanogpt", build("nanogpt", bias=False))
    assert not any(key.endswith(".bias") for key in plan["parameter"])
    with pytest.raises(ValueError, match='plan "nanogpt": .* no .config'):
        get_plan("nanogpt", nn.Linear(2, 2))


def test_hf_plans_read_the_config():
    pytest.importorskip("transformers")
    plan = get_plan("hf_llama", build("hf_llama", attention_bias=True))
    assert plan["parameter"][r"model.layers.\d+.self_attn.(q_proj|k_proj|v_proj).bias"] == [Shard(0)]
    assert r"model.layers.\d+.mlp.down_proj.bias" not in plan["parameter"]
    with pytest.raises(ValueError, match="cross-attention"):
        get_plan("hf_gpt2", build("hf_gpt2", add_cross_attention=True))


def test_auto_with_expert_parallel_refuses_a_model_without_experts():
    with pytest.raises(ValueError, match=r"Linear has no experts the plan can divide over 'EP'.*data parallel"):
        get_plan("auto", nn.Linear(2, 2), expert_parallel=True)
