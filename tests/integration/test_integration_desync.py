"""DDP + an ndweave optimizer with one DP rank out of step: ``step()`` finishes the grad sync, where
the ranks' counts are compared, so every rank raises ``GradSyncDivergedError`` within seconds
instead of waiting in the optimizer's all-gather until the timeout."""

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


def _model_and_optimizer(kind: str):
    torch.manual_seed(0)
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=TIMEOUT_S))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = DDP(model, group, bucket_size=32, use_distributed_optimizer=kind == "zero")
    cls = DistributedOptimizer if kind == "zero" else BasicOptimizer
    return model, cls(torch.optim.AdamW, [model], optimizer_kwargs={"lr": 0.01}, grad_norm_group=group)


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
