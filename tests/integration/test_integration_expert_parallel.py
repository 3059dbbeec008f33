"""Expert parallelism end to end: a MoE model's experts divided over the "EP" dim of a ("DP", "EP")
mesh by the ``expert_parallel`` patch, DDP reducing dense grads over DP x EP and experts' over DP,
and ndweave's optimizers (ZeRO sharding each bucket over its own group, the global grad norm counting
each expert once) train exactly as one process does, in float64: loss, every grad, the norm and every
parameter after each step; plus the all-to-alls of a step."""

from __future__ import annotations

import functools

import pytest
import torch

from moe_models import (FLOAT32_SUMS, HF_MOE, ROWS, TinyMoE, build_hf_moe, check_expert_parallel,
                        count_all_to_alls, lm_batch, lm_loss, lm_loss_with_aux, lm_loss_with_aux_per_rank,
                        parallel_moe, tiny_batch, tiny_loss)
from ndweave.mesh.testing import STRICT
from ndweave.dmodule import get_plan
from ndweave.mesh.testing import run_distributed

TINY_PLAN = {"patch": {"experts": ["expert_parallel"]}}


@pytest.mark.parity
@pytest.mark.parametrize("zero", [False, True], ids=["basic", "zero"])
@pytest.mark.parametrize("dp, ep", [(1, 2), (2, 2)])
def test_tiny_moe_trains_like_one_process(dp, ep, zero):
    run_distributed(check_expert_parallel, dp * ep, TinyMoE, TINY_PLAN, dp=dp, ep=ep, make_batch=tiny_batch,
                    loss_of=tiny_loss, zero=zero, steps=3, num_moe_layers=1, timeout=180)


@pytest.mark.parametrize("dp, ep", [(1, 2), (2, 2), (1, 4)])
def test_a_steps_all_to_alls_per_moe_layer(dp, ep):
    run_distributed(_count_a_step, dp * ep, dp, ep, timeout=120)


def _count_a_step(dp, ep):
    # TinyMoE (one MoE layer): 4 experts, top-2, hidden 6, ROWS tokens per rank, float64
    torch.set_default_dtype(torch.float64)
    experts, top_k, hidden, elem = 4, 2, 6, 8
    torch.manual_seed(0)
    model, _ = parallel_moe(TinyMoE(experts, top_k, hidden), TINY_PLAN, dp=dp, ep=ep, zero=False)
    batch = tiny_batch(0, ROWS)
    off_rank: list[int] = []
    with count_all_to_alls(off_rank) as forward:
        out = model(batch[0])
    with count_all_to_alls(off_rank) as backward:
        torch.nn.functional.mse_loss(out, batch[1]).backward()
    rows = ROWS * top_k * hidden * elem  # every (token, expert) row, whichever rank holds its expert
    # forward: the counts (E/EP per EP rank and a flag), the rows there, the rows back; backward: both
    # moves of rows reversed. Each rank sends its own rows, and gets back as many as it sent
    counts, back = ep * (experts // ep + 1) * elem, forward[2]
    assert forward == [counts, rows, back] and backward == [rows, back], (forward, backward)
    # the rows back weigh what this rank's experts received: summed over the ranks, what they all sent
    received = torch.tensor([float(back)])
    torch.distributed.all_reduce(received)
    assert received.item() == dp * ep * rows
    assert off_rank[0] == (ep - 1) * (experts // ep + 1) * elem  # the counts to the other EP ranks
    assert all(0 <= b <= total for b, total in zip(off_rank[1:], forward[1:] + backward))


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("zero", [False, True], ids=["basic", "zero"])
@pytest.mark.parametrize("dp, ep", [(1, 2), (2, 2)])
def test_hf_mixtral_trains_like_one_process(dp, ep, zero):
    pytest.importorskip("transformers")
    _check_hf("hf_mixtral", dp, ep, zero)


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("family", sorted(set(HF_MOE) - {"hf_mixtral"}))
@pytest.mark.parametrize("dp, ep, zero", [(1, 2, False), (2, 2, True)], ids=["ep2_basic", "dp2_ep2_zero"])
def test_hf_moe_families_train_like_one_process(family, dp, ep, zero):
    pytest.importorskip("transformers")
    _check_hf(family, dp, ep, zero)


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("zero", [False, True], ids=["basic", "zero"])
def test_hf_mixtral_with_tensor_parallel_trains_like_one_process(zero):
    # ("DP", "EP", "TP") = (1, 2, 2): attention TP over "TP", experts over "EP" (whole over TP)
    pytest.importorskip("transformers")
    _check_hf("hf_mixtral", 1, 2, zero, tp=2)


def _check_hf(family: str, dp: int, ep: int, zero: bool, tp: int = 1) -> None:
    build = functools.partial(build_hf_moe, family)
    plan = get_plan(family, build(), expert_parallel=True)
    # 10 AdamW steps at DP x EP with ZeRO (the bar), 3 elsewhere
    steps, layers, float32_params = (10 if zero and dp > 1 else 3), 2, ()
    if family == "hf_deepseek_v3":
        # its first layer is dense; its router computes in float32 whatever the model's dtype, so the
        # router's grads are float32 sums over the tokens the ranks split (compared at float32
        # precision), and one step only: a router weight off by float32 rounding may flip a later top-k
        steps, layers, float32_params = 1, 1, ("mlp.gate.weight",)
    run_distributed(check_expert_parallel, dp * ep * tp, build, plan, dp=dp, ep=ep, tp=tp, make_batch=lm_batch,
                    loss_of=lm_loss, zero=zero, steps=steps, num_moe_layers=layers, float32_params=float32_params,
                    timeout=300)


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("coef", [0.0, 0.05])
@pytest.mark.parametrize("family", ["hf_mixtral", "hf_qwen2_moe"])
def test_the_load_balancing_loss_uses_each_ranks_tokens(family, coef):
    # Each rank adds router_aux_loss_coef x transformers' load-balancing loss of its own forward (its
    # own tokens' statistics, no collective): one process computing it on each rank's rows and
    # averaging trains the same. transformers sums it in float32: the loss and the routers' grads are
    # held to float32 rounding with a coefficient, and strictly (float64) with coefficient 0.
    pytest.importorskip("transformers")

    build = functools.partial(build_hf_moe, family, router_aux_loss_coef=coef)
    plan = get_plan(family, build(), expert_parallel=True)
    float32 = ("mlp.gate.weight",) if coef else ()
    run_distributed(check_expert_parallel, 4, build, plan, dp=2, ep=2, make_batch=lm_batch, loss_of=lm_loss_with_aux,
                    reference_loss_of=lm_loss_with_aux_per_rank, loss_tol=FLOAT32_SUMS if coef else STRICT,
                    zero=True, steps=3, num_moe_layers=2, float32_params=float32, timeout=300)


def test_a_tp_dim_of_one_rank_is_no_tensor_parallel():
    run_distributed(_tp_of_one_rank, 2, timeout=60)


def _tp_of_one_rank():
    # the GPT job's mesh names every dim: ("DP", "EP", "TP") = (1, 2, 1) divides the experts and leaves
    # every dense tensor plain, as ("DP", "EP") does
    from torch.distributed.tensor import DTensor

    from ndweave.dmodule import parallelize_module
    from ndweave.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("DP", "EP", "TP"))
    model = parallelize_module(TinyMoE(), mesh, TINY_PLAN)
    assert [n for n, p in model.named_parameters() if isinstance(p, DTensor)] == ["experts.w_in", "experts.w_out"]
    assert model.experts.w_in.device_mesh.mesh_dim_names == ("EP",)
    assert not isinstance(model(tiny_batch(0, ROWS)[0].float()), DTensor)
