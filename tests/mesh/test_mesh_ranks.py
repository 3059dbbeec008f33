"""ParallelMesh on real ranks: every role getter's group really holds the ranks the arithmetic says."""

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh import DEVICE_MESH, init_device_mesh, resolve_mesh
from ndweave.mesh.testing import distributed


def _members(group) -> list[int]:
    """Global ranks of ``group``, learned by communicating over it (not by asking torch)."""
    me = torch.tensor([dist.get_rank()])
    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, me, group=group)
    return [int(t) for t in out]


def _check_roles(mesh) -> None:
    coord = mesh.get_strategy_coordinate()
    for role, dim in (("pipeline", "PP"), ("data", "DP"), ("tensor", "TP")):
        rank = getattr(mesh, f"get_{role}_parallel_rank")()
        group = getattr(mesh, f"get_{role}_parallel_group")()
        sub = getattr(mesh, f"get_{role}_parallel_mesh")()
        if dim not in mesh.mesh_dim_names:
            assert (rank, group, sub) == (0, None, None), role
            continue
        axis = mesh.mesh_dim_names.index(dim)
        assert rank == coord[axis] == mesh.lookup_rank(dim) == sub.get_local_rank(), role
        siblings = [g for g in mesh.get_all_submeshes(dim) if dist.get_rank() in g]
        assert len(siblings) == 1
        assert _members(group) == siblings[0] == sub.mesh.tolist(), role
        assert sub.mesh_dim_names == (dim,)


@distributed(world_size=4)
def test_1d_2d_and_4d_meshes_on_4_ranks():
    for shape, names in [((4,), None), ((2, 2), None), ((1, 2, 1, 2), ("PP", "DP", "CP", "TP"))]:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        _check_roles(mesh)
        assert mesh.get_global_rank(mesh.get_strategy_coordinate()) == dist.get_rank()
        assert mesh.size() == 4 and mesh.shape == shape and mesh.ndim == len(shape)
        for axis, name in enumerate(mesh.mesh_dim_names):
            # a dim by name or by index, as a group or as a submesh: all the same ranks
            siblings = [g for g in mesh.get_all_submeshes(name) if dist.get_rank() in g][0]
            assert _members(mesh.get_group(axis)) == _members(mesh.get_group(name)) == siblings
            assert mesh.get_submesh(name).mesh.tolist() == siblings == mesh[name].mesh.tolist()
            assert mesh[name] is mesh[(name,)]  # sliced once (torch builds a new mesh per slice), kept per init
            assert mesh.size(name) == mesh.get_strategy_size(axis) == shape[axis]
    # a flattened view is a real group over the ranks it names
    mesh = init_device_mesh("cpu", (1, 2, 1, 2), mesh_dim_names=("PP", "DP", "CP", "TP"))
    flat = mesh.flatten(("DP", "CP"), "DPCP")
    assert _members(flat.get_group()) == mesh.get_all_submeshes("DPCP")[dist.get_rank() % 2]
    assert mesh.lookup_rank("DPCP") == dist.get_rank() // 2


@distributed(world_size=8, num_nodes=2)
def test_3d_mesh_on_two_nodes_of_four():
    # LOCAL_RANK repeats across nodes (rank 5 is local rank 1 on node 1); mapping must use global ranks.
    import os

    rank = dist.get_rank()
    assert int(os.environ["LOCAL_RANK"]) == rank % 4
    DEVICE_MESH.init_device_mesh("cpu", (2, 2, 2))
    _check_roles(DEVICE_MESH)
    assert DEVICE_MESH.get_strategy_coordinate() == (rank // 4, (rank // 2) % 2, rank % 2)
    assert DEVICE_MESH.get_strategy_coordinate(5) == (1, 0, 1) != DEVICE_MESH.get_strategy_coordinate(1)
    nxt, prev = DEVICE_MESH.neighbor_rank("PP", 1), DEVICE_MESH.neighbor_rank("PP", -1)
    assert (nxt, prev) == ((rank + 4, None) if rank < 4 else (None, rank - 4))
    assert DEVICE_MESH.is_first_stage() == (rank < 4) and DEVICE_MESH.is_last_stage() == (rank >= 4)
    # a pipeline walk: send my rank to the next stage over the real PP group
    if nxt is not None:
        dist.send(torch.tensor([rank]), nxt)
    else:
        got = torch.zeros(1, dtype=torch.long)
        dist.recv(got, prev)
        assert got.item() == prev


@distributed(world_size=4)
def test_seed_default_mesh_and_resolve():
    DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(2, 2), mesh_dim_names=("DP", "TP"))
    assert DEVICE_MESH.get_strategy_size("TP") == 2 and DEVICE_MESH.get_strategy_size("DP") == 2
    assert resolve_mesh(None, "TP").mesh.tolist() == DEVICE_MESH.get_all_submeshes("TP")[dist.get_rank() // 2]
    assert resolve_mesh(DEVICE_MESH).mesh.tolist() == [[0, 1], [2, 3]]
    two_d = DEVICE_MESH.get_submesh(("DP", "TP"))
    assert two_d.mesh.tolist() == [[0, 1], [2, 3]] and two_d.mesh_dim_names == ("DP", "TP")
    from_group = resolve_mesh(DEVICE_MESH.get_group("DP"), "DP")
    assert from_group.mesh.tolist() == DEVICE_MESH["DP"].mesh.tolist()
    with pytest.raises(KeyError, match="no dim 'PP'"):
        resolve_mesh(DEVICE_MESH.device_mesh, "PP")
    text = repr(DEVICE_MESH)
    assert f"rank {dist.get_rank()} at DP=" in text and "*" in text


@distributed(world_size=2, init_process_group=False)
def test_init_device_mesh_creates_the_process_group():
    assert not dist.is_initialized()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert _members(mesh.get_group("DP")) == [0, 1]
