"""Users switching: a veScale script with only its imports changed, and torch's DeviceMesh tutorial's
HSDP snippet with a mesh from either ndweave entry point; both checked against one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, fully_shard
from torch.distributed.tensor import Replicate, Shard

# --- veScale's imports, changed; the rest of the script is as veScale users write it
from ndweave.mesh import DEVICE_MESH as VESCALE_DEVICE_MESH
from ndweave.dmodule import parallelize_module
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.optim import DistributedOptimizer
# ---
from ndweave.mesh import DEVICE_MESH, init_device_mesh
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


sharding_plan = {
    "parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)], "fc2.bias": [Replicate()]},
    "forward": {"fc1.input": [[Replicate()]], "fc2.output": [[Replicate()]]},
}


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


@pytest.mark.parity
@distributed(world_size=4)
def test_vescale_seed_flow_with_changed_imports_matches_one_process():
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(2, 2), mesh_dim_names=("DP", "TP"))
    if VESCALE_DEVICE_MESH.get_strategy_size("TP") > 1:
        model = parallelize_module(model, VESCALE_DEVICE_MESH["TP"], sharding_plan)
    if VESCALE_DEVICE_MESH.get_strategy_size("DP") > 1:
        model = DDP(model, VESCALE_DEVICE_MESH["DP"], use_distributed_optimizer=True)
    if VESCALE_DEVICE_MESH.get_strategy_size("DP") > 1:
        optimizer = DistributedOptimizer(torch.optim.Adam, models=[model], clip_grad=1.0,
                                         optimizer_kwargs={"lr": 0.01})
    dp, dp_rank = VESCALE_DEVICE_MESH.get_strategy_size("DP"), VESCALE_DEVICE_MESH.get_data_parallel_rank()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(3):
        X, Y = _data(step)
        optimizer.zero_grad()
        loss = F.mse_loss(model(X[dp_rank::dp]), Y[dp_rank::dp])
        loss.backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        F.mse_loss(reference(X), Y).backward()  # the mean over DP of the shards' means: the same loss
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, q, name=name)


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def _hsdp_mesh(entry_point: str):
    # HSDP: MeshShape(2, 2) (the tutorial's (2, 4) on 8 GPUs)
    if entry_point == "init_device_mesh":
        return init_device_mesh("cpu", (2, 2))
    DEVICE_MESH.init_device_mesh("cpu", (2, 2))
    return DEVICE_MESH


@pytest.mark.parity
@pytest.mark.parametrize("entry_point", ["init_device_mesh", "DEVICE_MESH"])
@distributed(world_size=4)
def test_torch_hsdp_snippet_takes_either_ndweave_mesh(entry_point):
    """The tutorial's HSDP. FSDP1 (the snippet's ``FSDP(..., device_mesh=mesh_2d, HYBRID_SHARD)``)
    refuses a CPU-only machine before it looks at the mesh; here FSDP1 is shown to accept the mesh,
    and the same HSDP runs with FSDP2 (``fully_shard`` over the 2-D mesh: replicate x shard)."""
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference = ToyModel()
    mesh_2d = _hsdp_mesh(entry_point)
    with pytest.raises(RuntimeError, match="accelerator"):  # not "Expected device_mesh to have ndim=2"
        FSDP(ToyModel(), device_mesh=mesh_2d, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    model = copy.deepcopy(reference)
    fully_shard(model, mesh=mesh_2d)
    rank = torch.distributed.get_rank()
    x = torch.randn(8, 10, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(x[rank::4]), y[rank::4]).backward()
    optimizer.step()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.mse_loss(reference(x), y).backward()
    ref_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.device_mesh == mesh_2d
        assert_close(p, q, name=name)
