"""get_plan("auto", model): on the zoo's families it finds the zoo's hand-written plan (the same
placement for every parameter and every forward input/output), and that plan trains like one process."""

import io

import pytest
import torch
from dmodule_zoo_models import build, check_deferred, check_parity

from ndweave.dmodule.plan import match_modules
from ndweave.dmodule.spec import split_key
from ndweave.dmodule.plans import get_plan, list_plans, load_plan, save_plan
from ndweave.mesh.testing import distributed

ZOO = ["mlp", "nanogpt", "hf_llama", "hf_gpt2"]
MODES = pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])


def _needs(name: str) -> None:
    if name.startswith("hf_"):
        pytest.importorskip("transformers")


def resolved(model: torch.nn.Module, plan: dict) -> dict[tuple[str, str], str]:
    """(section, "<module fqn>.<leaf>") -> repr of the value, for every module each key matches."""
    out = {}
    for section in ("parameter", "forward"):
        for key, value in plan.get(section, {}).items():
            regex, leaf = split_key(key)
            for fqn, _ in match_modules(model, regex, key):
                out[(section, f"{fqn}.{leaf}")] = repr(value)
    return out


def test_list_plans_names_auto():
    assert "auto" in list_plans()


@MODES
@pytest.mark.parametrize("name", ZOO)
def test_auto_finds_the_zoo_plan(name, sequence_parallel):
    _needs(name)
    torch.manual_seed(0)
    model = build(name)
    zoo = resolved(model, get_plan(name, model, sequence_parallel=sequence_parallel))
    auto = resolved(model, get_plan("auto", model, sequence_parallel=sequence_parallel))
    differ = {k: (zoo.get(k), auto.get(k)) for k in sorted(set(zoo) | set(auto)) if zoo.get(k) != auto.get(k)}
    assert not differ, f"auto differs from the zoo's {name} plan (zoo, auto): {differ}"


@pytest.mark.parametrize("name", ZOO)
def test_auto_plan_is_json(name):
    _needs(name)
    model = build(name)
    plan = get_plan("auto", model, sequence_parallel=True)
    text = io.StringIO()
    save_plan(plan, text)
    assert resolved(model, load_plan(io.StringIO(text.getvalue()))) == resolved(model, plan)
    assert load_plan(io.StringIO(text.getvalue()))["patch"] == plan["patch"]


def test_auto_leaves_the_model_alone():
    """Deriving traces a meta copy: the model's parameters, attributes and hooks are untouched."""
    pytest.importorskip("transformers")
    model = build("hf_gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    split_size = model.transformer.h[0].attn.split_size
    get_plan("auto", model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.transformer.h[0].attn.split_size == split_size
    assert not model.transformer.h[0]._forward_hooks and not model.transformer.h[0]._forward_pre_hooks


@pytest.mark.parity
@MODES
@pytest.mark.parametrize("name", ["nanogpt", "hf_llama", "hf_gpt2"])
@distributed(world_size=2, timeout=120)
def test_auto_plan_matches_one_process_on_2_ranks(name, sequence_parallel):
    _needs(name)
    check_parity(name, plan="auto", sequence_parallel=sequence_parallel)


@pytest.mark.parity
@pytest.mark.parametrize("name", ["nanogpt", "hf_gpt2"])
@distributed(world_size=2, timeout=120)
def test_auto_plan_with_deferred_init(name):
    _needs(name)
    check_deferred(name, plan="auto")


@distributed(world_size=2, timeout=120)
def test_deferred_init_with_the_auto_plan_keeps_only_local_shards():
    """The plan is derived from the deferred (fake) model itself; each rank then materializes only
    its shards (the strided q|k|v columns of GPT-2 included), bit-equal to eager init."""
    pytest.importorskip("transformers")
    from torch.distributed.device_mesh import init_device_mesh

    from ndweave.dmodule import deferred_init, parallelize_module

    torch.manual_seed(0)
    eager = build("hf_gpt2")
    torch.manual_seed(0)
    model = deferred_init(build, "hf_gpt2")
    model = parallelize_module(model, init_device_mesh("cpu", (2,)), get_plan("auto", model))
    for (fqn, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
        assert torch.equal(q.full_tensor(), p), f"{fqn} differs from eager init"
    stats = model._materialize_stats
    local = sum(t.to_local().numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert stats.local_bytes == local, stats
    assert stats.peak_bytes <= local + stats.largest_full_param_bytes, stats
