"""The seed's VeDeviceMesh snippet, as users type it, on 4 ranks."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import distributed


@distributed(world_size=4)
def test_seed_snippet_dp_tp_mesh():
    # initialize a mesh of size (2, 2) as the seed does
    DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(2, 2), mesh_dim_names=("DP", "TP"))
    assert DEVICE_MESH.get_strategy_size("TP") == 2 and DEVICE_MESH.get_strategy_size("DP") == 2
    tp_mesh = DEVICE_MESH["TP"]
    # the TP view is a torch DeviceMesh that DTensor takes directly
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    shard = distribute_tensor(full, tp_mesh, [Shard(1)])
    assert shard.to_local().shape == (4, 3)
    assert torch.equal(shard.redistribute(tp_mesh, [Replicate()]).to_local(), full)
    # the DP view groups the ranks that hold the same TP shard
    dp_rank = torch.tensor([DEVICE_MESH.get_data_parallel_rank()])
    dist.all_reduce(dp_rank, group=DEVICE_MESH.get_data_parallel_group())
    assert dp_rank.item() == 0 + 1
