"""What users do with a wrapped model: deepcopy it (EMA, eval copies), its params and grads, its
state dict; reach the module's attributes through the wrapper; torch's ``get_state_dict``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ndweave.ddp import DDP
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import distributed


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        return self.transformer(x)


def _tp_net() -> Net:
    """Net with its linears TP-sharded (column then row) over DEVICE_MESH["TP"]."""
    net, tp = Net(), DEVICE_MESH["TP"]
    first, last = net.transformer[0], net.transformer[2]
    for module, name, placement in [(first, "weight", Shard(0)), (first, "bias", Shard(0)),
                                    (last, "weight", Shard(1)), (last, "bias", Replicate())]:
        setattr(module, name, nn.Parameter(distribute_tensor(getattr(module, name).detach(), tp, [placement])))
    return net


def _backward(ddp) -> None:
    x = distribute_tensor(torch.randn(3, 4), DEVICE_MESH["TP"], [Replicate()])
    ((ddp(x).full_tensor() - 1) ** 2).mean().backward()


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@distributed(world_size=4)
def test_deepcopies_are_independent_of_the_buckets(use_distributed_optimizer):
    DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    ddp = DDP(_tp_net(), DEVICE_MESH, use_distributed_optimizer=use_distributed_optimizer)
    _backward(ddp)
    weight = ddp.transformer[0].weight
    module, param, main_grad, state = (copy.deepcopy(ddp.module), copy.deepcopy(weight),
                                       copy.deepcopy(weight.main_grad), copy.deepcopy(ddp.state_dict()))
    values = {name: p.full_tensor().clone() for name, p in ddp.named_parameters()}
    grad = weight.grad.full_tensor().clone()
    # wipe everything the buckets hold: the copies keep their values
    with torch.no_grad():
        for p in ddp.parameters():
            p.to_local().fill_(7.0)
    ddp.zero_grad_buffer()
    assert isinstance(param, DTensor) and torch.equal(param.full_tensor(), values["transformer.0.weight"])
    assert torch.equal(param.grad.full_tensor(), grad) and torch.equal(main_grad.full_tensor(), grad)
    for name, p in module.named_parameters():
        assert torch.equal(p.full_tensor(), values[name]), name
        assert torch.equal(state[name].full_tensor(), values[name]), name
    assert torch.equal(module.transformer[0].weight.grad.full_tensor(), grad)
    # the copy trains on its own: no DDP hooks came along, the original buffers stay untouched
    module.zero_grad()
    _backward(module)
    assert all(b.abs().sum() == 0 for b in ddp._grad_buffers)
    assert module.transformer[0].weight.grad is not None


@distributed(world_size=2)
def test_the_wrapper_forwards_attributes_and_torch_get_state_dict_works():
    DEVICE_MESH.init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    net = Net()
    ddp = DDP(net, DEVICE_MESH)
    assert ddp.transformer is net.transformer and ddp.module is net
    with pytest.raises(AttributeError, match="nope"):
        ddp.nope
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.1)
    ((ddp(torch.randn(3, 4)) - 1) ** 2).mean().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(ddp, optimizer)
    assert set(model_state) == set(net.state_dict())
    assert set(optim_state["state"]) == {name for name, _ in net.named_parameters()}
