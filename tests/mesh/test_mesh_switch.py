"""What veScale and torch users type against a mesh: veScale's VeDeviceMesh spellings, and a
``ParallelMesh`` passed wherever torch takes a ``DeviceMesh``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ndweave.mesh import DEVICE_MESH, ParallelMesh, init_device_mesh
from ndweave.mesh.testing import distributed


from ndweave.mesh import fake_world
def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


@distributed(world_size=4)
def test_vescale_spellings_answer_with_the_named_dims():
    mesh = DEVICE_MESH
    assert mesh.get() is None  # veScale: None before init
    dm = mesh.get(device_type="cpu", mesh_shape=(2, 1, 2), mesh_dim_names=("PP", "DP", "TP"))
    assert isinstance(dm, DeviceMesh) and dm == mesh.device_mesh and mesh.get() is mesh.device_mesh
    rank = dist.get_rank()
    assert mesh.get_coordinate() == mesh.get_strategy_coordinate() == (rank // 2, 0, rank % 2)
    assert mesh.get_strategy_coordinate(local_rank=3) == mesh.get_strategy_coordinate(3) == (1, 0, 1)
    assert mesh.get_local_rank() == rank  # rank on its node (LOCAL_RANK): one node
    # groups of the named dims (veScale's TP "dim groups" are mesh dim 0's: the PP dim here)
    assert _ranks(mesh.get_tensor_parallel_dim_groups()) == [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(mesh.get_pipeline_parallel_dim_groups()) == [rank % 2, rank % 2 + 2]
    assert _ranks(mesh.get_data_parallel_dim_groups()) == [rank]
    tp = mesh.get_global_tensor_parallel_meshes()
    assert all(isinstance(m, DeviceMesh) for m in tp)
    assert [m.mesh.tolist() for m in tp] == [[0, 1], [2, 3]] and tp[rank // 2] == mesh["TP"]
    pp = mesh.get_global_pipeline_parallel_meshes()
    assert [m.mesh.tolist() for m in pp] == [[[0, 1]], [[2, 3]]]
    assert pp[rank // 2] == mesh["DP", "TP"] and pp[rank // 2].mesh_dim_names == ("DP", "TP")
    assert pp[1 - rank // 2].get_coordinate() is None  # another stage's mesh: this rank is not in it
    with pytest.raises(TypeError, match="not both"):
        mesh.get_strategy_coordinate(1, local_rank=1)


def test_global_meshes_without_the_dim():
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("DP",))
        assert [m.mesh.tolist() for m in mesh.get_global_pipeline_parallel_meshes()] == [[0, 1, 2, 3]]
        with pytest.raises(KeyError, match="no dim 'TP'"):
            mesh.get_global_tensor_parallel_meshes()
        assert mesh.get_tensor_parallel_dim_groups() is None


def _toy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))


@distributed(world_size=4)
def test_a_parallel_mesh_is_a_torch_device_mesh():
    # torch's tutorial, with ndweave's init_device_mesh
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    assert isinstance(mesh_2d, DeviceMesh) and isinstance(mesh_2d, ParallelMesh)
    assert mesh_2d == mesh_2d.device_mesh and hash(mesh_2d) == hash(mesh_2d.device_mesh)
    rank = dist.get_rank()
    assert _ranks(mesh_2d.get_group(mesh_dim="replicate")) == [rank % 2, rank % 2 + 2]
    assert _ranks(mesh_2d.get_group(mesh_dim=1)) == _ranks(mesh_2d.get_group("shard")) == [rank - rank % 2, rank - rank % 2 + 1]
    assert mesh_2d.size(mesh_dim=1) == 2 and mesh_2d.size() == 4 and mesh_2d.get_local_rank(mesh_dim="shard") == rank % 2
    with pytest.raises(RuntimeError, match="mesh_dim="):
        mesh_2d.get_group()
    # DTensors on the ParallelMesh and on the torch mesh it equals mix freely
    full = torch.arange(16.0).reshape(4, 4)
    a = distribute_tensor(full, mesh_2d, [Replicate(), Shard(0)])
    b = distribute_tensor(full, mesh_2d.device_mesh, [Replicate(), Shard(0)])
    assert torch.equal((a + b).full_tensor(), 2 * full)
    # FSDP2 over a 1-D ParallelMesh, from either entry point
    for mesh in (init_device_mesh("cpu", (4,), mesh_dim_names=("DP",)),
                 DEVICE_MESH.init_device_mesh("cpu", (4,), mesh_dim_names=("DP",)) and DEVICE_MESH):
        model = _toy()
        fully_shard(model, mesh=mesh)
        model(torch.randn(3, 10)).sum().backward()
        assert isinstance(model[0].weight, DTensor) and model[0].weight.grad is not None


def test_an_uninitialized_mesh_says_so():
    mesh = ParallelMesh()
    with pytest.raises(AttributeError, match="not initialized; call .init_device_mesh"):
        mesh.get_coordinate()
    with fake_world(2):
        mesh.init_device_mesh("cpu", (2,))
        assert mesh.get_coordinate() == (0,)
        mesh.reset()
        with pytest.raises(AttributeError, match="not initialized"):
            mesh.get_coordinate()
