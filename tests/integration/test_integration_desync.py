"""DDP + an ndweave optimizer with one DP rank out of step: every rank raises ``GradSyncDivergedError``
within seconds instead of waiting in the optimizer's all-gather until the timeout. On gloo the ranks'
counts ride collectives the step makes anyway (the last bucket's all-reduce, the parameter gathers on
a group of their own): a step in step gathers nothing for the check."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndweave.ddp import DDP, GradSyncDivergedError
from ndweave.mesh.testing import distributed
from ndweave.optim import BasicOptimizer, DistributedOptimizer

TIMEOUT_S = 5  # on a group of the test's own: the reduction left without a partner fails there


def _model_and_optimizer(kind: str, *, detect_desync: bool = True):
    torch.manual_seed(0)
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=TIMEOUT_S))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = DDP(model, group, bucket_size=32, use_distributed_optimizer=kind != "basic", detect_desync=detect_desync)
    if kind == "basic":
        return model, BasicOptimizer(torch.optim.AdamW, [model], optimizer_kwargs={"lr": 0.01}, grad_norm_group=group)
    return model, DistributedOptimizer(torch.optim.AdamW, [model], optimizer_kwargs={"lr": 0.01}, grad_norm_group=group,
                                       overlap_param_gather=kind == "zero-overlap")


def _step(model, optimizer, *, backward: bool = True) -> None:
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    if backward:
        loss.backward()
    optimizer.step()


@pytest.mark.parametrize("fault", ["skipped_backward", "extra_step"])
@pytest.mark.parametrize("kind", ["zero", "basic"])
@distributed(world_size=2)
def test_a_rank_out_of_step_fails_every_rank_fast(kind, fault):
    model, optimizer = _model_and_optimizer(kind)
    _step(model, optimizer)
    start = time.monotonic()
    expected = r"rank 1 \(DP rank 1\).*(skipped a backward\(\)|forward\(s\) with grad since the last sync)"
    with pytest.raises(GradSyncDivergedError, match=expected):
        odd = dist.get_rank() == 1
        if fault == "skipped_backward":
            _step(model, optimizer, backward=not odd)
            _step(model, optimizer)
        else:
            if odd:
                optimizer.step()
            _step(model, optimizer)
    assert time.monotonic() - start < TIMEOUT_S


@pytest.mark.parametrize("kind", ["zero", "zero-overlap", "basic"])
@distributed(world_size=2)
def test_a_rank_that_skips_its_step_fails_every_rank_fast(kind):
    """An exception caught between backward and step() on one rank: the others' parameter gathers (on
    a group of their own) never pair with its next backward's reductions, and both sides' waits post
    their counts, so every rank names the skipped step."""
    model, optimizer = _model_and_optimizer(kind)
    _step(model, optimizer)
    start = time.monotonic()
    # (BasicOptimizer's step has no collective here: rank 0 is named in its next backward's sync)
    rank_0 = r"(called step\(\) a 2nd time|finishes grad sync #3 .* 2 step\(\)s so far)"
    with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) finishes grad sync #3 after 1 backward "
                                                    rf"pass\(es\).*DP rank 0 {rank_0}.*: rank 1 skipped a step\(\) "
                                                    r"DP rank 0 called"):
        x, y = torch.randn(4, 6), torch.randn(4, 3)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if dist.get_rank() == 0:
            optimizer.step()
        _step(model, optimizer)
    assert time.monotonic() - start < TIMEOUT_S


@pytest.mark.parametrize("kind", ["zero", "zero-overlap", "basic"])
@distributed(world_size=2)
def test_steps_in_step_gather_nothing_for_the_check_and_train_as_unchecked(kind, monkeypatch):
    """No check gather in a whole step (the rows ride the last bucket's all-reduce and the step's
    gathers), a rank late to step() by two of a check's slices is waited for, not named, and the
    params equal those of the same run with the check off."""
    from ndweave.ddp import desync

    gathers = []
    real = desync.gather_rows
    monkeypatch.setattr(desync, "gather_rows", lambda *a, **k: gathers.append(a[2][0]) or real(*a, **k))
    params = {}
    for detect in (True, False):
        model, optimizer = _model_and_optimizer(kind, detect_desync=detect)
        torch.manual_seed(1)
        for step in range(4):
            x, y = torch.randn(4, 6), torch.randn(4, 3)
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            if detect and dist.get_rank() == step % 2:
                time.sleep(0.6)  # late: its peer's wait posts its row and reads the board meanwhile
            optimizer.step()
        if kind == "zero-overlap":
            optimizer.wait_param_gather()
        params[detect] = [p.detach().clone() for p in model.parameters()]
    assert gathers == []
    for checked, unchecked in zip(params[True], params[False]):
        assert torch.equal(checked, unchecked)
