"""Inside ``no_sync()``, ``.grad`` is the local sum, as with torch's DDP: a torch optimizer stepping
there (local SGD, or by mistake) does what it does with torch's DDP, instead of nothing; a
``zero_grad()`` there drops the local sum. Compared with torch's DDP itself, float64, strict."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_cases import MLP, batch, rows
from ndweave.ddp import DDP
from ndweave.mesh.testing import assert_close, distributed


def _loop(model, opt, grads_seen: list, steps: int) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        x, y = batch(step)
        x, y = rows(x, rank, size), rows(y, rank, size)
        with model.no_sync():
            F.mse_loss(model(x[:4]), y[:4]).backward()
            F.mse_loss(model(x[4:8]), y[4:8]).backward()
            grads_seen.append([p.grad.clone() for p in model.parameters()])
            if step % 2 == 0:  # a step inside no_sync: local grads, as torch's DDP has them
                opt.step()
                opt.zero_grad()
        F.mse_loss(model(x[8:]), y[8:]).backward()
        grads_seen.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()


@pytest.mark.parity
@pytest.mark.parametrize("zero_layout", [False, True])
@distributed(world_size=2)
def test_grads_inside_no_sync_and_steps_there_match_torch_ddp(zero_layout):
    base = MLP()
    ours = DDP(copy.deepcopy(base), dist.group.WORLD, bucket_size=100, use_distributed_optimizer=zero_layout)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    seen = {}
    for name, model in (("ndweave", ours), ("torch", theirs)):
        seen[name] = []
        # a layout for a sharded optimizer holds synced grads only in this rank's shard range (a torch
        # optimizer cannot step it): there, compare the local sums of one step's no_sync block
        _loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), seen[name], 1 if zero_layout else 4)
    if zero_layout:
        seen = {k: v[:1] for k, v in seen.items()}
    for i, (a, b) in enumerate(zip(seen["ndweave"], seen["torch"])):
        for j, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, name=f"grad {j} at backward group {i}")
    for (name, p), q in zip(ours.named_parameters(), theirs.module.parameters()):
        if not zero_layout:
            assert_close(p, q, name=name)


@distributed(world_size=2)
def test_a_wider_grad_buffer_leaves_grad_none_inside_no_sync():
    model = DDP(MLP(dtype=torch.bfloat16), dist.group.WORLD)  # fp32 grads of bf16 params: no view
    x, y = batch(0, dtype=torch.bfloat16)
    with model.no_sync():
        F.mse_loss(model(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    F.mse_loss(model(x), y).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
