"""The seed's MLP example, as written (CPU mesh instead of CUDA), checked against one process: through
``ndweave.dmodule``, and as a veScale script with only its imports changed (``ndweave.dmodule.vescale``,
veScale's defaults: the output is a DTensor, and veScale users call ``output.to_local()``)."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import ndweave.dmodule
import ndweave.dmodule.vescale  # veScale's `from vescale.dmodule.api import parallelize_module`, changed
from ndweave.dmodule import DModule
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed

from ndweave.mesh import fake_world
NDWEAVE, VESCALE = ndweave.dmodule, ndweave.dmodule.vescale
ENTRY_POINTS = {"ndweave": NDWEAVE, "vescale": VESCALE}


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


def _seed_example(world_size: int, deferred: bool, entry_point: str = "ndweave") -> None:
    api = ENTRY_POINTS[entry_point]
    parallelize_module, deferred_init = api.parallelize_module, api.deferred_init  # the script's imports
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

    if api is VESCALE:  # veScale's output: a Replicate DTensor, whose local tensor is the whole value
        assert VESCALE.is_dmodule(dmlp) and output.placements == (Replicate(),)
        output = output.to_local()
    assert type(output) is torch.Tensor  # ndweave's: a Replicate root output comes back plain (use_local_output)
    expected = ref(input)
    expected.sum().backward()
    assert_close(output, expected, name="output")
    for (name, p), (_, q) in zip(dmlp.named_parameters(), ref.named_parameters()):
        assert_close(p, q, name=name)
        assert_close(p.grad, q.grad, name=f"{name}.grad")
        assert p.grad.placements == p.placements, name


@pytest.mark.parity
@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
@pytest.mark.parametrize("deferred", [False, True])
@distributed(world_size=2)
def test_seed_mlp_example_world2(deferred, entry_point):
    _seed_example(2, deferred, entry_point)


@pytest.mark.parity
@pytest.mark.parametrize("deferred", [False, True])
@distributed(world_size=4)
def test_seed_mlp_example_world4(deferred):
    _seed_example(4, deferred)


def test_vescale_grad_sync_forms():
    with fake_world(2):
        mesh = DeviceMesh("cpu", [0, 1])
        # veScale's per-class selection: accepted (finish_grad_sync reduces every Partial gradient)
        plan = {"forward": {"fc1.input": [[Replicate()]]}}
        dmlp = VESCALE.parallelize_module(MLP(), mesh, plan, grad_sync={nn.LayerNorm: ["weight"]})
        assert isinstance(dmlp(torch.randn(2, 4)), DTensor)  # veScale's default: outputs stay DTensors
        with pytest.raises(ValueError, match="grad_sync=False is not supported: finish_grad_sync.. reduces every"):
            VESCALE.parallelize_module(MLP(), mesh, plan, grad_sync=False)
