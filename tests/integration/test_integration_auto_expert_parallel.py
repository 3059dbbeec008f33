"""``get_plan("auto", model, expert_parallel=True)``: experts found from the model's structure (no
names read) divided over "EP" as the zoo's MoE plans divide them, the dense parts planned as "auto"
plans them (tensor parallel over "TP"); and every MoE family at EP=2 x TP=2 with the zoo's plan and
with auto, against one process in float64 (loss, every grad, then AdamW steps with ZeRO)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from moe_models import (HF_MOE, ListMoE, Scrambled, TinyMoE, build_hf_moe, check_expert_parallel, lm_batch, lm_loss,
                        scrambled_batch, tiny_batch, tiny_loss)
from ndweave.dmodule import explain_plan, get_plan
from ndweave.mesh.testing import run_distributed

TINY_INPUTS = ((torch.zeros(3, 5),), {})  # TinyMoE / ListMoE take (rows, 5)


def _expert_modules(model: nn.Module, plan: dict) -> set[str]:
    keys = [k for k, entries in plan["patch"].items() if "expert_parallel" in entries]
    return {fqn for fqn, _ in model.named_modules() for k in keys if re.fullmatch(k, fqn)}


def _planned_inside(plan: dict, modules: set[str]) -> list[str]:
    """Parameter / forward keys naming anything inside ``modules`` (the experts are the patch's alone)."""
    return [k for section in ("parameter", "forward") for k in plan[section]
            if any(re.fullmatch(k.rsplit(".", 1)[0], m) or k.startswith(m + ".") for m in modules)]


@pytest.mark.parametrize("family", sorted(HF_MOE))
def test_auto_divides_the_experts_the_zoo_divides(family):
    pytest.importorskip("transformers")
    model = build_hf_moe(family)
    auto, zoo = get_plan("auto", model, expert_parallel=True), get_plan(family, model, expert_parallel=True)
    experts = _expert_modules(model, auto)
    assert experts and experts == _expert_modules(model, zoo)
    assert _planned_inside(auto, experts) == []


def test_auto_finds_experts_without_names():
    plan = get_plan("auto", Scrambled(), expert_parallel=True)   # q: experts run with bmm on gathered weights
    assert _expert_modules(Scrambled(), plan) == {"b.0.q", "b.1.q"}
    assert plan["patch"][r"b.\d+.q"] == ["expert_parallel"] and _planned_inside(plan, {"b.0.q", "b.1.q"}) == []
    tiny = get_plan("auto", TinyMoE(), expert_parallel=True, example_inputs=TINY_INPUTS)
    assert tiny["patch"]["experts"] == ["expert_parallel"] and "experts.w_in" not in tiny["parameter"]


def test_what_is_not_stacked_experts_is_said_and_refused():
    # a ModuleList of expert modules: the dispatch takes one module stacking them
    with pytest.raises(ValueError, match=r"ModuleList \('experts'\).*stack each layer's experts"):
        get_plan("auto", ListMoE(), expert_parallel=True, example_inputs=TINY_INPUTS)
    # ... beside stacked experts: those are divided, the list is planned as before and explain says why
    model = ListMoE(stacked_too=True)
    plan = get_plan("auto", model, expert_parallel=True, example_inputs=TINY_INPUTS)
    assert _expert_modules(model, plan) == {"stacked"}
    report = explain_plan(model, plan, example_inputs=TINY_INPUTS)
    assert "experts: not expert parallel" in report and "ModuleList" in report
    assert "its experts are divided over 'EP'" in report
    with pytest.raises(ValueError, match="Sequential has no experts.*make the 'EP' ranks data parallel"):
        get_plan("auto", nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 2)), expert_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True is not written yet"):
        get_plan("auto", Scrambled(), expert_parallel=True, sequence_parallel=True)


def _check_cases(cases: list[tuple], **mesh) -> None:
    """``check_expert_parallel`` for each ``(build, plan, make_batch, loss_of, extra)``, on one pool."""
    for build, plan, make_batch, loss_of, extra in cases:
        check_expert_parallel(build, plan, make_batch=make_batch, loss_of=loss_of, **mesh, **extra)


def _tiny_cases() -> list[tuple]:
    tiny = get_plan("auto", TinyMoE(), expert_parallel=True, example_inputs=TINY_INPUTS)
    scrambled = get_plan("auto", Scrambled(), expert_parallel=True)
    return [(TinyMoE, tiny, tiny_batch, tiny_loss, dict(steps=3, num_moe_layers=1)),
            (Scrambled, scrambled, scrambled_batch, tiny_loss, dict(steps=3, num_moe_layers=2))]


def _hf_case(family: str, plan_name: str) -> tuple:
    build = functools.partial(build_hf_moe, family)
    plan = get_plan(plan_name, build(), expert_parallel=True)
    extra = dict(steps=3, num_moe_layers=2)
    if family == "hf_deepseek_v3":  # its first layer dense; its router in float32 (see test_integration_expert_parallel)
        extra = dict(steps=1, num_moe_layers=1, float32_params=("mlp.gate.weight",))
    return build, plan, lm_batch, lm_loss, extra


@pytest.mark.parity
def test_auto_plans_of_our_moe_models_train_like_one_process_at_ep2():
    run_distributed(_check_cases, 2, _tiny_cases(), dp=1, ep=2, zero=False, timeout=180)


@pytest.mark.heavy
@pytest.mark.parity
def test_auto_plans_train_like_one_process_at_dp2_ep2_with_zero():
    pytest.importorskip("transformers")
    cases = _tiny_cases() + [_hf_case(family, "auto") for family in sorted(HF_MOE)]
    run_distributed(_check_cases, 4, cases, dp=2, ep=2, zero=True, timeout=600)


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("family", sorted(HF_MOE))
def test_moe_families_at_ep2_tp2_train_like_one_process(family):
    # ("DP", "EP", "TP") = (1, 2, 2): attention and dense MLPs over "TP", experts over "EP" (whole over
    # TP); the zoo's plan (Mixtral's is tested in test_integration_expert_parallel) and auto's, each
    # with every grad checked (BasicOptimizer), then with ZeRO
    pytest.importorskip("transformers")
    plans = ["auto"] + ([family] if family != "hf_mixtral" else [])
    cases = [_hf_case(family, name) for name in plans]
    run_distributed(_check_cases, 4, cases, dp=1, ep=2, tp=2, zero=False, timeout=600)
    run_distributed(_check_cases, 4, cases, dp=1, ep=2, tp=2, zero=True, timeout=600)
