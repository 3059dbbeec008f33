"""The seed's MLP example, as written (CPU mesh instead of CUDA), checked against one process."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndweave.dmodule import DModule, deferred_init, parallelize_module
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        x = self.fc1(x)
        x = self.relu(x)
        x = self.fc2(x)
        return x


def _seed_example(world_size: int, deferred: bool) -> None:
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    # deferred initialization, or regular initialization
    mlp = deferred_init(MLP) if deferred else MLP()
    # parallelize model into DModule with "manual plans"
    dmlp = parallelize_module(mlp,
                              DeviceMesh("cpu", list(range(world_size))),
                              param_sharding_plan={
                                  "fc1.weight": [Shard(0)],
                                  "fc1.bias": [Shard(0)],
                                  "fc2.weight": [Shard(1)],
                                  "fc2.bias": [Replicate()],
                              },
                              fwd_resharding_plan={
                                  "fc1.input": [[Replicate()]],  # change to Shard(<dim>) for SP/DP
                                  "fc2.output": [[Replicate()]],
                              })
    assert isinstance(dmlp, DModule) and isinstance(dmlp, MLP)
    torch.manual_seed(1)
    input = torch.randn(3, 4)
    # forward in TP
    output = dmlp(input)
    # backward in TP
    output.sum().backward()
    # wait for gradient synchronization
    dmlp.finish_grad_sync()

    expected = ref(input)
    expected.sum().backward()
    assert not isinstance(output, DTensor)  # a Replicate root output comes back plain (use_local_output)
    assert_close(output, expected, name="output")
    for (name, p), (_, q) in zip(dmlp.named_parameters(), ref.named_parameters()):
        assert_close(p, q, name=name)
        assert_close(p.grad, q.grad, name=f"{name}.grad")
        assert p.grad.placements == p.placements, name


@pytest.mark.parity
@pytest.mark.parametrize("deferred", [False, True])
@distributed(world_size=2)
def test_seed_mlp_example_world2(deferred):
    _seed_example(2, deferred)


@pytest.mark.parity
@pytest.mark.parametrize("deferred", [False, True])
@distributed(world_size=4)
def test_seed_mlp_example_world4(deferred):
    _seed_example(4, deferred)
