"""DistributedOptimizer against single-device torch.optim: DP, DP x TP (float64, strict), bf16 with
fp32 masters (measured bound), overlap."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh.testing import Tolerance, assert_close, distributed, measured_tolerance, run_distributed
from ndweave.optim import DistributedOptimizer

from optim_common import (
    assert_params_match, batch, dp_setup, local_batch, loss_fn, mean_micro_batch_grads, tp_setup, train,
    train_reference,
)

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9}),
}
STEPS = 20


def _check_dp(name: str, clip: float, overlap: bool) -> None:
    cls, kwargs = OPTIMIZERS[name]
    reference, ddp = dp_setup()
    opt = DistributedOptimizer(cls, models=[ddp], optimizer_kwargs=kwargs, clip_grad=clip, overlap_param_gather=overlap)
    assert len(ddp.grad_buckets()) >= 4
    train(ddp, opt, STEPS, dist.get_rank(), dist.get_world_size())
    opt.wait_param_gather()
    train_reference(reference, cls(reference.parameters(), **kwargs), STEPS, clip)
    assert_params_match(ddp.module, reference)


@pytest.mark.parity
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("world_size", [2, 4], ids=["dp2", "dp4"])
def test_dp_matches_single_device(world_size, name, clip, overlap):
    run_distributed(_check_dp, world_size, name, clip, overlap)


@pytest.mark.parity
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@distributed(world_size=4)
def test_dp2_tp2_matches_single_device(name, clip, overlap):
    cls, kwargs = OPTIMIZERS[name]
    reference, ddp, dp_rank, dp_size = tp_setup()
    opt = DistributedOptimizer(cls, models=[ddp], optimizer_kwargs=kwargs, clip_grad=clip, overlap_param_gather=overlap)
    train(ddp, opt, STEPS, dp_rank, dp_size)
    opt.wait_param_gather()
    train_reference(reference, cls(reference.parameters(), **kwargs), STEPS, clip)
    assert_params_match(ddp.module, reference)


def _check_norm(ddp, reference, dp_rank, dp_size) -> None:
    opt = DistributedOptimizer(torch.optim.SGD, [ddp], optimizer_kwargs={"lr": 0.0})
    x, y = local_batch(0, dp_rank, dp_size)
    loss_fn(ddp(x), y).backward()
    xf, yf = batch(0)
    loss_fn(reference(xf), yf).backward()
    for norm_type in (float("inf"), 2.0):  # inf first: it must not clip
        ours = opt.clip_grad_norm(1e9, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9, norm_type)
        assert ours.dtype == torch.float64, "a float64 model's norm is taken in float64"
        assert_close(ours, expected, name=f"{norm_type}-norm")
    # clipping scales each owned element once: the norm afterwards is the reference's after clipping
    opt.clip_grad_norm(0.01)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    assert_close(opt.clip_grad_norm(1e9), torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9),
                 name="norm after clipping")


@pytest.mark.parity
@distributed(world_size=4)
def test_grad_norm_equals_single_device_norm_dp():
    reference, ddp = dp_setup()
    _check_norm(ddp, reference, dist.get_rank(), 4)


@pytest.mark.parity
@distributed(world_size=4)
def test_grad_norm_equals_single_device_norm_dp_tp():
    """Shard placements are summed over TP, Replicate ones (row-parallel bias, layer 4) counted once."""
    reference, ddp, dp_rank, dp_size = tp_setup()
    _check_norm(ddp, reference, dp_rank, dp_size)


def _bf16_master_reference(reference, world: int, reverse: bool) -> dict[str, torch.Tensor]:
    """The fp32 masters of the bf16 reference after STEPS (``reverse``: grads summed in the other order)."""
    reference = copy.deepcopy(reference)
    masters = {n: torch.nn.Parameter(p.detach().float()) for n, p in reference.named_parameters()}
    ref_opt = torch.optim.Adam(masters.values(), lr=1e-2)
    for step in range(STEPS):
        grads = mean_micro_batch_grads(reference, step, world, torch.bfloat16, reverse=reverse)
        for n, m in masters.items():
            m.grad = grads[n]
        ref_opt.step()
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(masters[n])
    return {n: m.detach() for n, m in masters.items()}


#: bf16 params are casts of fp32 masters that agree to a measured bound: at most one bf16 rounding apart
BF16_ROUNDING = Tolerance(rtol=torch.finfo(torch.bfloat16).eps, atol=0.0)


@pytest.mark.kernels
@pytest.mark.parity
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@distributed(world_size=4)
def test_bf16_model_with_fp32_master_matches_fp32_master_reference(overlap):
    """Reference, precisely: one process holds the same bf16 model and an fp32 master copy of every
    param. Each step it runs every DP rank's micro-batch through the bf16 model (forward and backward
    in bf16, as the ranks do), casts each micro-batch's grads to fp32 and averages them (what the
    fp32 grad buffer's reduce-scatter computes), steps torch.optim.Adam on the fp32 masters and
    writes bf16(master) into the model. Masters must match to fp32 tolerance, params to bf16."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, ddp = dp_setup(dtype=torch.bfloat16, grad_dtype=torch.float32)
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-2}, overlap_param_gather=overlap)
    assert opt.master_param_bytes() > 0
    train(ddp, opt, STEPS, rank, world, dtype=torch.bfloat16)
    full = opt.gather_full_state_dict()

    masters = _bf16_master_reference(reference, world, reverse=False)
    tol = measured_tolerance(masters, _bf16_master_reference(reference, world, reverse=True))
    for n, m in masters.items():
        assert_close(full["state"][n]["master_param"], m, name=f"{n} master", tol=tol)
    opt.wait_param_gather()
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(masters[n])
    assert_params_match(ddp.module, reference, tol=BF16_ROUNDING)
    assert next(ddp.module.parameters()).dtype == torch.bfloat16


@pytest.mark.parity
@distributed(world_size=2)
def test_overlap_waits_every_bucket_before_its_first_module():
    reference, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-2}, overlap_param_gather=True)
    buckets = ddp.grad_buckets()
    first_layer = {id(p) for p in ddp.module[0].parameters()}
    first_buckets = {i for i, b in enumerate(buckets) if any(id(bp.param) in first_layer for bp in b.params)}
    for step in range(3):
        train(ddp, opt, 1, dist.get_rank(), 2, first_step=step)
        assert opt.pending_param_gathers() == list(range(len(buckets)))  # issued, not waited on
        ddp.module[0](torch.zeros(1, 8, dtype=torch.float64))  # only the first layer's buckets are needed now
        assert set(opt.pending_param_gathers()) == set(range(len(buckets))) - first_buckets
        ddp(torch.zeros(1, 8, dtype=torch.float64))  # the rest of the forward waits for the rest, each bucket once per step
        assert opt.pending_param_gathers() == []
        assert opt.param_gather_waits == [step + 1] * len(buckets)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    train_reference(reference, ref_opt, 3)
    assert_params_match(ddp.module, reference)


def _bf16_direct_reference(reference, world: int, reverse: bool) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(reference)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(5):
        grads = mean_micro_batch_grads(reference, step, world, torch.bfloat16, reverse=reverse)
        for n, p in reference.named_parameters():
            p.grad = grads[n].to(torch.bfloat16)
        ref_opt.step()
    return {n: p.detach() for n, p in reference.named_parameters()}


@pytest.mark.kernels
@pytest.mark.parity
@distributed(world_size=4)  # (4, not 2: reversing a sum of two is no reordering to measure)
def test_grad_to_fp32_false_steps_the_bf16_params_directly():
    """No master copy: the reference steps bf16 params with torch.optim.Adam, fed bf16(mean of the
    ranks' fp32-cast micro-batch grads), which is what the fp32 buffer's reduce-scatter then the
    cast compute."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, ddp = dp_setup(dtype=torch.bfloat16, grad_dtype=torch.float32)
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-2}, grad_to_fp32=False)
    assert opt.master_param_bytes() == 0
    train(ddp, opt, 5, rank, world, dtype=torch.bfloat16)
    expected = _bf16_direct_reference(reference, world, reverse=False)
    tol = measured_tolerance(expected, _bf16_direct_reference(reference, world, reverse=True))
    opt.wait_param_gather()
    for n, p in ddp.module.named_parameters():
        assert_close(p, expected[n], name=n, tol=tol)
