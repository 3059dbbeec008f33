"""Faults and misuse: inf/nan grads (``on_nonfinite``), a step without backward, a state dict from
another model. Each decided the same way on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh.testing import ReferenceDataParallel, distributed
from ndweave.optim import BasicOptimizer, DistributedOptimizer, NonFiniteGradError, StateDictMismatchError

from optim_common import assert_params_match, dp_setup, local_batch, loss_fn, make_model, train, train_reference


def _poisoned_step(ddp, opt, rank: int, step: int = 3) -> None:
    """A step whose grads are nan on rank 1 only (no loss scaler)."""
    opt.zero_grad()
    x, y = local_batch(step, rank, 2)
    if rank == 1:
        x = x.clone()
        x[0, 0] = float("nan")
    loss_fn(ddp(x), y).backward()
    opt.step()


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
@distributed(world_size=2)
def test_nonfinite_grads_raise_on_every_rank_by_default(clip):
    _, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-2}, clip_grad=clip)
    train(ddp, opt, 2, dist.get_rank(), 2)
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    with pytest.raises(NonFiniteGradError, match=r"grad norm is nan.*on_nonfinite='skip'"):
        _poisoned_step(ddp, opt, dist.get_rank())
    for n, p in ddp.module.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        BasicOptimizer(torch.optim.SGD, [make_model()], optimizer_kwargs={"lr": 0.1}, on_nonfinite="warn")


@pytest.mark.parity
@pytest.mark.parametrize("kind", ["distributed", "basic"])
@distributed(world_size=2)
def test_nonfinite_grads_skip_the_step_on_every_rank_and_training_goes_on(kind):
    """A skipped step changes nothing: the run equals one process that never saw that batch."""
    rank = dist.get_rank()
    reference, ddp = dp_setup(use_distributed_optimizer=kind == "distributed")
    cls = DistributedOptimizer if kind == "distributed" else BasicOptimizer
    opt = cls(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-2}, clip_grad=0.05, on_nonfinite="skip")
    train(ddp, opt, 3, rank, 2)
    with pytest.warns(RuntimeWarning, match="skipped this step on every rank"):
        _poisoned_step(ddp, opt, rank)
    assert opt.last_step_skipped
    train(ddp, opt, 2, rank, 2, first_step=3)
    assert not opt.last_step_skipped
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_reference(reference, ref_opt, 5, clip=0.05)
    assert_params_match(ddp.module, reference)


@pytest.mark.parity
@distributed(world_size=1)
def test_step_without_backward_leaves_params_untouched_like_torch():
    """AdamW with weight decay: a step with no backward since zero_grad() changes nothing (torch skips
    grad-less params); a step on grads not zeroed repeats the last update, as in torch."""
    reference, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for ours, model in ((opt, ddp), (ref_opt, reference)):
        for step in range(2):
            ours.zero_grad()
            x, y = local_batch(step, 0, 1)
            loss_fn(model(x), y).backward()
            ours.step()
        ours.step()  # grads kept: steps again
        ours.zero_grad()
        ours.step()  # no backward since zero_grad: nothing to do
    assert_params_match(ddp.module, reference)
    for n, p in reference.named_parameters():
        assert opt.state_dict()["state"][n]["step"] == ref_opt.state[p]["step"], n


@distributed(world_size=2)
def test_unchecked_steps_through_nonfinite_grads_as_torch_does():
    """The opt-out: no norm computed without clipping, and a nan grad reaches the params (torch's way)."""
    _, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.SGD, [ddp], optimizer_kwargs={"lr": 0.1}, on_nonfinite="unchecked")
    _poisoned_step(ddp, opt, dist.get_rank())
    assert not opt.last_step_skipped and opt._step_norm is None
    assert torch.isnan(ddp.module[0].weight).any()


def _other_model_state(rank: int):
    """The state dict of an AdamW over another model: Linear(8,16) - Tanh - Linear(16,4), so '2.weight'
    has another shape and '4.weight', '4.bias' are missing."""
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    ddp = ReferenceDataParallel(other, dist.group.WORLD, bucket_size=64, alignment=1, use_distributed_optimizer=True)
    opt = DistributedOptimizer(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-2})
    x, y = local_batch(0, rank, 2)
    loss_fn(ddp(x), y[:, :4]).backward()
    opt.step()
    return opt.state_dict()


@distributed(world_size=2)
def test_loading_another_models_state_raises_on_every_rank_naming_each_mismatch():
    rank = dist.get_rank()
    _, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-2})
    train(ddp, opt, 1, rank, 2)
    own, other = opt.state_dict(), _other_model_state(rank)
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    with pytest.raises(StateDictMismatchError) as caught:
        opt.load_state_dict(other)
    message = str(caught.value)
    assert "no state for this optimizer's parameters ['4.weight', '4.bias']" in message and "strict=False" in message
    assert "'2.weight': global shape [4, 16] in the state, [16, 16] in the model" in message
    with pytest.raises(StateDictMismatchError, match="global shape") as caught:  # shapes are checked anyway
        opt.load_state_dict(other, strict=False)
    assert "no state for" not in str(caught.value)
    # only rank 1 loads the wrong one: rank 0 raises too (instead of waiting in the all-gather)
    with pytest.raises(StateDictMismatchError, match="rank 1: .*'2.weight'"):
        opt.load_state_dict(other if rank == 1 else own)
    for n, p in ddp.module.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    opt.load_state_dict(own)  # the right one still loads
    train(ddp, opt, 1, rank, 2, first_step=1)
