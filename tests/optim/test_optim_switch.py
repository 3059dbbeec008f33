"""veScale's DistributedOptimizer arguments, and a data-parallel rank that owns only bucket padding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import STRICT_DTYPE, ReferenceDataParallel, assert_close, distributed
from ndweave.optim import DistributedOptimizer

CLIP = 0.05


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))  # 37 params: one 256-element bucket


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g, dtype=STRICT_DTYPE), torch.randn(8, 2, generator=g, dtype=STRICT_DTYPE)


def _train(model, optimizer, steps, rank=0, size=1, clip=None):
    for step in steps:
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rank::size]), y[rank::size]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()


def _wrapped(model):  # the mesh's reference wrapper: optim is tested with only itself and mesh installed
    ddp = ReferenceDataParallel(model, DEVICE_MESH.device_mesh, use_distributed_optimizer=True)
    return ddp, DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 0.01}, clip_grad=CLIP,
                                     grad_scaler=None, fp16=False, bf16=False, params_dtype=STRICT_DTYPE)


@pytest.mark.parity
@distributed(world_size=4)
def test_ranks_owning_only_padding_clip_save_and_resume():
    torch.set_default_dtype(STRICT_DTYPE)
    DEVICE_MESH.init_device_mesh("cpu", (4,), mesh_dim_names=("DP",))
    rank = dist.get_rank()
    reference = _tiny()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    ddp, opt = _wrapped(copy.deepcopy(reference))
    (bucket,) = ddp.grad_buckets()
    owns = bucket.shard_range()[0] < 37
    assert owns == (rank == 0)  # 37 params padded to 4 x 64: ranks 1-3 own padding only
    assert sorted(p.numel() for p in opt.get_parameters()) == ([2, 5, 10, 20] if owns else [0])
    _train(ddp, opt, range(3), rank, 4)
    _train(reference, ref_opt, range(3), clip=CLIP)
    for (name, p), q in zip(ddp.named_parameters(), reference.parameters()):
        assert_close(p, q, name=name)
    # checkpoint-style: every rank's state dict, loaded into a fresh run, resumes identically
    state = opt.state_dict()
    assert bool(state["state"]) == owns
    everyone = [None] * 4
    dist.all_gather_object(everyone, state)
    ddp2, opt2 = _wrapped(_tiny())
    opt2.load_state_dict(everyone)
    _train(ddp, opt, [3], rank, 4)
    _train(ddp2, opt2, [3], rank, 4)
    _train(reference, ref_opt, [3], clip=CLIP)
    for (name, p), p2, q in zip(ddp.named_parameters(), ddp2.parameters(), reference.parameters()):
        assert_close(p2, p, name=name)
        assert_close(p, q, name=name)


@distributed(world_size=2)
def test_vescale_arguments_map_or_say_why_not():
    DEVICE_MESH.init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    ddp = ReferenceDataParallel(_tiny(), DEVICE_MESH.device_mesh, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match=r"bf16=True.*model.to\(torch.bfloat16\)"):
        DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 0.1}, bf16=True)
    with pytest.raises(ValueError, match="not both"):
        DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 0.1}, grad_scaler=object(),
                             loss_scaler=object())

    class Scaler:  # Megatron's grad scaler shape: a scale and update(found_inf)
        scale = torch.tensor(4.0)

        def update(self, found_inf: bool) -> None:
            self.found_inf = found_inf

    opt = DistributedOptimizer(torch.optim.SGD, [ddp], optimizer_kwargs={"lr": 0.1}, grad_scaler=Scaler())
    assert isinstance(opt.loss_scaler, Scaler)
    x, y = _batch(0)
    before = [p.detach().clone() for p in ddp.parameters()]
    (nn.functional.mse_loss(ddp(x.float()), y.float()) * float("inf")).backward()
    opt.step()
    assert opt.last_step_skipped and opt.loss_scaler.found_inf
    assert all(torch.equal(p, q) for p, q in zip(ddp.parameters(), before))
