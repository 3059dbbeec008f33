"""The grad norm without a collective where every rank holds every grad alike (buckets all-reduced
whole over the norm's whole group, as ``ndweave.ddp`` does on gloo): the same norm, clip and
non-finite check as with one all-reduce, and the one-process result; a TP split falls back to it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from ndweave.mesh.testing import distributed, run_distributed
from ndweave.optim import BasicOptimizer, DistributedOptimizer, NonFiniteGradError

from optim_common import (assert_params_match, dp_setup, local_batch, loss_fn, make_model, tp_setup, train,
                          train_reference)
from test_optim_parity import OPTIMIZERS, STEPS, _check_norm


def all_reduces(comms: CommDebugMode) -> int:
    """The all-reduces torch's ``CommDebugMode`` saw (the norm's collective; param gathers are all-gathers)."""
    return comms.get_comm_counts().get(torch.ops.c10d.allreduce_, 0)


def _norm_collectives(ddp, cls=DistributedOptimizer, **kwargs) -> int:
    """All-reduces one ``step()`` makes beyond the grad sync (finished before counting)."""
    opt = cls(torch.optim.SGD, [ddp], optimizer_kwargs={"lr": 0.1}, **kwargs)
    x, y = local_batch(0, dist.get_rank() % 2, 2)
    loss_fn(ddp(x), y).backward()
    if hasattr(ddp, "finish_grad_sync"):
        ddp.finish_grad_sync()
    with CommDebugMode() as comms:
        opt.step()
    opt.zero_grad()
    return all_reduces(comms)


@distributed(world_size=2)
def test_whole_buckets_need_no_norm_collective():
    for kwargs in ({}, {"clip_grad": 0.05}, {"on_nonfinite": "skip"}):
        assert _norm_collectives(dp_setup(reduce_whole=True)[1], **kwargs) == 0, kwargs
        assert _norm_collectives(dp_setup()[1], **kwargs) == 1, kwargs  # reduce-scattered: owned ranges
        all_reduced = dp_setup(use_distributed_optimizer=False)[1]
        assert _norm_collectives(all_reduced, BasicOptimizer, **kwargs) == 0, kwargs
        assert _norm_collectives(make_model(), BasicOptimizer, **kwargs) == 1, kwargs  # unwrapped: every rank's own


@distributed(world_size=2)
def test_a_param_group_outside_the_buckets_brings_the_collective_back():
    """A param no bucket syncs holds this rank's own grad: the ranks' norms must be summed again."""
    _, ddp = dp_setup(use_distributed_optimizer=False)
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = BasicOptimizer(torch.optim.SGD, [ddp], optimizer_kwargs={"lr": 0.1})
    opt.add_param_group({"params": [extra]})
    x, y = local_batch(0, dist.get_rank(), 2)
    (loss_fn(ddp(x), y) + extra.sum() * (dist.get_rank() + 1)).backward()
    ddp.finish_grad_sync()
    with CommDebugMode() as comms:
        norm = opt.clip_grad_norm(1e9)
    assert all_reduces(comms) == 1
    # the bucketed grads counted once, the extra grads of both ranks (1s and 2s) each
    bucketed = torch.stack([p.grad.norm() for p in ddp.module.parameters()]).square().sum()
    torch.testing.assert_close(norm, (bucketed + 3 * (1 + 4)).sqrt(), rtol=1e-12, atol=0)


def _check_dp(name: str, clip: float) -> None:
    cls, kwargs = OPTIMIZERS[name]
    reference, ddp = dp_setup(reduce_whole=True)
    opt = DistributedOptimizer(cls, models=[ddp], optimizer_kwargs=kwargs, clip_grad=clip)
    train(ddp, opt, STEPS, dist.get_rank(), dist.get_world_size())
    opt.wait_param_gather()
    train_reference(reference, cls(reference.parameters(), **kwargs), STEPS, clip)
    assert_params_match(ddp.module, reference)


@pytest.mark.parity
@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("world_size", [2, 4], ids=["dp2", "dp4"])
def test_whole_buckets_match_single_device(world_size, clip):
    run_distributed(_check_dp, world_size, "adamw", clip)


def _check_basic(clip: float) -> None:
    reference, ddp = dp_setup(use_distributed_optimizer=False)
    opt = BasicOptimizer(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-2}, clip_grad=clip)
    train(ddp, opt, STEPS, dist.get_rank(), dist.get_world_size())
    train_reference(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), STEPS, clip)
    assert_params_match(ddp.module, reference)


@pytest.mark.parity
@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
@distributed(world_size=2)
def test_basic_optimizer_over_all_reduced_buckets_matches_single_device(clip):
    _check_basic(clip)


@pytest.mark.parity
@distributed(world_size=4)
def test_whole_norm_equals_single_device_norm():
    """Both norms, then clipping (this rank's range only) and the norm after it: from the owned ranges."""
    reference, ddp = dp_setup(reduce_whole=True)
    _check_norm(ddp, reference, dist.get_rank(), 4)


@pytest.mark.parity
@distributed(world_size=4)
def test_whole_buckets_over_dp_only_of_dp_x_tp_take_the_collective():
    reference, ddp, dp_rank, dp_size = tp_setup(reduce_whole=True)
    _check_norm(ddp, reference, dp_rank, dp_size)
    assert _norm_collectives(tp_setup(reduce_whole=True)[1]) == 1


@distributed(world_size=2)
def test_nonfinite_whole_grads_raise_on_every_rank():
    _, ddp = dp_setup(reduce_whole=True)
    opt = DistributedOptimizer(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-2})
    x, y = local_batch(0, dist.get_rank(), 2)
    if dist.get_rank() == 1:  # one rank's input: after the all-reduce every rank's grads are nan
        x = x.clone()
        x[0, 0] = float("nan")
    loss_fn(ddp(x), y).backward()
    with pytest.raises(NonFiniteGradError, match="grad norm is nan"):
        opt.step()
