"""The optimizers' surface: construction errors, optimizer instances with groups, lr schedulers,
BasicOptimizer, loss scaling."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh.testing import distributed
from ndweave.optim import BasicOptimizer, DistributedOptimizer, DynamicLossScaler

from optim_common import (
    assert_params_match, dp_setup, local_batch, loss_fn, make_model, tp_setup, train, train_reference,
)


class MyElementwiseSGD(torch.optim.SGD):
    pass


@distributed(world_size=2)
def test_construction_errors_name_the_option():
    _, ddp = dp_setup()
    with pytest.raises(ValueError, match="BasicOptimizer"):
        DistributedOptimizer(torch.optim.LBFGS, [ddp])
    with pytest.raises(ValueError, match="assume_elementwise=True"):
        DistributedOptimizer(MyElementwiseSGD, [ddp], optimizer_kwargs={"lr": 0.1})
    DistributedOptimizer(MyElementwiseSGD, [ddp], optimizer_kwargs={"lr": 0.1}, assume_elementwise=True)
    with pytest.raises(TypeError, match="DataParallelWrapper"):
        DistributedOptimizer(torch.optim.Adam, [make_model()])
    _, allreduce_ddp = dp_setup(use_distributed_optimizer=False)
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        DistributedOptimizer(torch.optim.Adam, [allreduce_ddp])
    with pytest.raises(ValueError, match="use_distributed_optimizer=False"):
        BasicOptimizer(torch.optim.Adam, [ddp])


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]


@distributed(world_size=4)
def test_an_optimizer_instance_keeps_its_groups_and_schedulers_drive_it():
    """AdamW built over the model's params with two groups, under StepLR then LambdaLR."""
    reference, ddp, dp_rank, dp_size = tp_setup()
    inner = torch.optim.AdamW(_groups(ddp.module), lr=1e-2)
    opt = DistributedOptimizer(inner, [ddp], clip_grad=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    train(ddp, opt, 8, dp_rank, dp_size, scheduler=sched)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    train(ddp, opt, 6, dp_rank, dp_size, first_step=8, scheduler=sched2)

    ref_opt = torch.optim.AdamW(_groups(reference), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    train_reference(reference, ref_opt, 8, clip=0.1, scheduler=ref_sched)
    ref_sched2 = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 1.0 / (1 + step))
    train_reference(reference, ref_opt, 6, clip=0.1, first_step=8, scheduler=ref_sched2)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert_params_match(ddp.module, reference)


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
@distributed(world_size=4)
def test_basic_optimizer_over_allreduce_ddp_matches_single_device(clip):
    reference, ddp = dp_setup(use_distributed_optimizer=False)
    opt = BasicOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-2}, clip_grad=clip)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    train(ddp, opt, 20, dist.get_rank(), 4, scheduler=sched)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    train_reference(reference, ref_opt, 20, clip, scheduler=torch.optim.lr_scheduler.StepLR(ref_opt, 5, 0.5))
    assert_params_match(ddp.module, reference)
    opt.zero_grad()  # zeroes the DDP buffers too
    assert all(not b.grad_data.any() for b in ddp.grad_buckets())


@distributed(world_size=4)
def test_basic_optimizer_grad_norm_counts_dp_replicas_once():
    reference, ddp = dp_setup(use_distributed_optimizer=False)
    opt = BasicOptimizer(torch.optim.SGD, [ddp], optimizer_kwargs={"lr": 0.0})
    x, y = local_batch(0, dist.get_rank(), 4)
    loss_fn(ddp(x), y).backward()
    from optim_common import batch

    xf, yf = batch(0)
    loss_fn(reference(xf), yf).backward()
    torch.testing.assert_close(opt.clip_grad_norm(1e9), torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))


@distributed(world_size=2, timeout=60)
def test_last_grad_norm_is_the_steps_global_norm_before_clipping():
    reference, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.SGD, [ddp], optimizer_kwargs={"lr": 0.1}, clip_grad=1e-3)
    assert opt.last_grad_norm is None
    x, y = local_batch(0, dist.get_rank(), 2)
    loss_fn(ddp(x), y).backward()
    opt.step()
    from optim_common import batch

    xf, yf = batch(0)
    loss_fn(reference(xf), yf).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
    assert abs(opt.last_grad_norm - expected) <= 1e-12 * expected and expected > 1e-3


@distributed(world_size=4)
def test_basic_optimizer_on_a_tp_model_without_ddp():
    """Plain TP (no DP wrapper): the norm sums Shard placements and counts Replicate ones once."""
    reference, ddp, _, _ = tp_setup()
    model = ddp.module  # the DTensor model itself, fed the same batch on every rank
    tp_group = model[0].weight.device_mesh.get_group()
    # both DP coordinates run the same model: the norm is the TP group's
    opt = BasicOptimizer(torch.optim.SGD, [model], optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, clip_grad=0.05,
                         grad_norm_group=tp_group)
    train(model, opt, 10, 0, 1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    train_reference(reference, ref_opt, 10, clip=0.05)
    assert_params_match(model, reference)


@distributed(world_size=2)
def test_loss_scaling_unscales_and_skips_overflowing_steps():
    rank = dist.get_rank()
    reference, ddp = dp_setup()
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=1000)
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-2}, clip_grad=0.05,
                               loss_scaler=scaler)
    for step in range(5):
        opt.zero_grad()
        x, y = local_batch(step, rank, 2)
        (loss_fn(ddp(x), y) * scaler.scale).backward()
        opt.step()
        assert not opt.last_step_skipped
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    opt.zero_grad()
    x, y = local_batch(5, rank, 2)
    x = x.clone()
    if rank == 1:
        x[0, 0] = float("inf")  # one rank overflows: every rank must skip
    (loss_fn(ddp(x), y) * scaler.scale).backward()
    opt.step()
    assert opt.last_step_skipped and scaler.scale == 512.0
    for n, p in ddp.module.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    train_reference(reference, ref_opt, 5, clip=0.05)
    assert_params_match(ddp.module, reference)


class _ScaleBySequence(torch.nn.Module):
    """A replicated weight applied to a sequence-sharded activation: its grad comes out Partial."""

    def __init__(self, mesh):
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.weight = torch.nn.Parameter(distribute_tensor(torch.linspace(0.5, 1.5, 8), mesh, [Replicate()]))

    def forward(self, x):
        return x * self.weight


@distributed(world_size=2)
def test_basic_optimizer_reduces_partial_grads_before_stepping():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    model = _ScaleBySequence(mesh)
    opt = BasicOptimizer(torch.optim.SGD, [model], optimizer_kwargs={"lr": 0.1})
    x = torch.arange(32.0).reshape(4, 8) / 32
    local = x[dist.get_rank() * 2 : (dist.get_rank() + 1) * 2]
    opt.zero_grad()
    model(DTensor.from_local(local, mesh, [Shard(0)])).sum().backward()
    assert model.weight.grad.placements[0].is_partial()  # what the step must reduce first
    opt.step()
    assert not any(p.is_partial() for p in model.weight.grad.placements)
    expected = torch.linspace(0.5, 1.5, 8) - 0.1 * x.sum(0)
    torch.testing.assert_close(model.weight.full_tensor(), expected)


@pytest.mark.parametrize("kind", ["distributed", "basic"])
@distributed(world_size=2)
def test_torch_optimizer_hooks_and_zero_grad_set_to_none(kind):
    """What torch users register on an optimizer works on ours, in torch's order and signatures."""
    _, ddp = dp_setup(use_distributed_optimizer=kind == "distributed")
    cls = DistributedOptimizer if kind == "distributed" else BasicOptimizer
    opt = cls(torch.optim.SGD, [ddp], optimizer_kwargs={"lr": 0.1})
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o is opt)))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o is opt)))

    x, y = local_batch(0, dist.get_rank(), 2)
    loss_fn(ddp(x), y).backward()
    opt.step()
    assert calls == [("pre", True), ("post", True)]
    sd = opt.state_dict()
    assert sd["extra"] == 1 and calls[-1] == ("sd_pre", True)
    opt.load_state_dict(sd)  # the pre hook removes "extra" again, or loading would refuse it
    assert calls[-1] == ("load_post", True)

    loss_fn(ddp(x), y).backward()
    opt.step()
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    assert grads, "a step leaves grads on the optimizer's params"
    opt.zero_grad(set_to_none=False)
    assert all(g is not None and not g.any() for g in
               (p.grad for group in opt.param_groups for p in group["params"] if p.numel()))
    opt.zero_grad()
    assert all(p.grad is None for group in opt.param_groups for p in group["params"])
