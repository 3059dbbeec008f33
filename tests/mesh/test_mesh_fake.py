"""ParallelMesh logic at sizes no test machine can run, over torch's fake process group."""

import numpy as np
import pytest

from ndweave.mesh import DEVICE_MESH, ParallelMesh, init_device_mesh
from ndweave.mesh import fake_world


@pytest.mark.parametrize("rank", [0, 5, 21, 63])
def test_64_ranks_3d_roles_match_arithmetic(rank):
    with fake_world(64, rank=rank):
        mesh = init_device_mesh("cpu", (4, 4, 4))  # default names PP, DP, TP
        assert mesh.mesh_dim_names == ("PP", "DP", "TP")
        pp, dp, tp = rank // 16, (rank // 4) % 4, rank % 4
        assert mesh.get_strategy_coordinate() == (pp, dp, tp)
        assert (mesh.get_pipeline_parallel_rank(), mesh.get_data_parallel_rank(), mesh.get_tensor_parallel_rank()) == (pp, dp, tp)
        assert mesh.get_tensor_parallel_mesh().mesh.tolist() == [16 * pp + 4 * dp + i for i in range(4)]
        assert mesh.get_data_parallel_mesh().mesh.tolist() == [16 * pp + 4 * i + tp for i in range(4)]
        assert mesh.get_pipeline_parallel_mesh().mesh.tolist() == [16 * i + 4 * dp + tp for i in range(4)]
        assert mesh.is_first_stage() == (pp == 0) and mesh.is_last_stage() == (pp == 3)
        assert mesh.neighbor_rank("PP", 1) == (rank + 16 if pp < 3 else None)
        assert mesh.neighbor_rank("PP", -1) == (rank - 16 if pp > 0 else None)
        assert mesh.get_global_rank({"PP": pp, "DP": dp, "TP": tp}) == rank


def test_4d_mesh_needs_names_and_maps_every_rank():
    with fake_world(48, rank=29):
        with pytest.raises(ValueError, match="needs mesh_dim_names"):
            init_device_mesh("cpu", (2, 2, 3, 4))
        mesh = init_device_mesh("cpu", (2, 2, 3, 4), mesh_dim_names=("PP", "DP", "CP", "TP"))
        assert mesh.ndim == 4 and mesh.size() == 48 and mesh.shape == (2, 2, 3, 4)
        for r in range(48):
            assert mesh.get_global_rank(mesh.get_strategy_coordinate(r)) == r
        assert mesh.get_strategy_coordinate() == (1, 0, 1, 1)  # 29 = 1*24 + 0*12 + 1*4 + 1
        assert mesh.lookup_rank("CP") == 1 and mesh.lookup_rank("TP") == 1
        dp_cp = mesh.flatten(("DP", "CP"), "DPCP")
        assert dp_cp.size() == 6 and mesh.get_strategy_size("DPCP") == 6
        assert mesh.lookup_rank("DPCP") == 0 * 3 + 1
        assert mesh["DPCP"].mesh.tolist() == mesh.get_all_submeshes("DPCP")[1 * 4 + 1]  # sibling index over (PP, TP)
        assert "DPCP=(DP,CP)" in mesh.describe()


def test_multi_node_coordinates_use_the_global_rank(monkeypatch):
    # 2 nodes x 4 ranks: rank 5 is LOCAL_RANK 1 on node 1; its coordinates must not be rank 1's.
    monkeypatch.setenv("LOCAL_RANK", "1")
    coords = {}
    for rank in (1, 5):
        with fake_world(8, rank=rank):
            mesh = init_device_mesh("cpu", (2, 2, 2))
            coords[rank] = mesh.get_strategy_coordinate()
            assert mesh.get_strategy_coordinate(rank=5) == (1, 0, 1)
    assert coords == {1: (0, 0, 1), 5: (1, 0, 1)}


def test_default_mesh_uniqueness_and_reset():
    with fake_world(4):
        DEVICE_MESH.init_device_mesh("cpu", (2, 2), check_uniqueness=True)
        with pytest.raises(RuntimeError, match="already initialized as ParallelMesh\\(DP=2, TP=2\\)"):
            DEVICE_MESH.init_device_mesh("cpu", (4,), check_uniqueness=True)
        DEVICE_MESH.init_device_mesh("cpu", (4,))  # without the check, re-init replaces
        assert DEVICE_MESH.mesh_dim_names == ("TP",)
    assert not DEVICE_MESH.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        DEVICE_MESH["TP"]


def test_bad_inputs_say_what_to_do():
    with fake_world(8):
        with pytest.raises(ValueError, match=r"holds 4 ranks but the world has 8 processes"):
            init_device_mesh("cpu", (2, 2))
        with pytest.raises(ValueError, match=r"repeat \['DP'\]"):
            init_device_mesh("cpu", (2, 4), mesh_dim_names=("DP", "DP"))
        with pytest.raises(ValueError, match="has 1 names but mesh_shape"):
            init_device_mesh("cpu", (2, 4), mesh_dim_names=("DP",))
        mesh = init_device_mesh("cpu", (2, 4))
        with pytest.raises(KeyError, match=r"no dim 'PP'; its dims are \['DP', 'TP'\]"):
            mesh.get_strategy_size("PP")
        with pytest.raises(KeyError, match="no dim 'XP'"):
            mesh["XP"]
        with pytest.raises(ValueError, match="missing: \\['TP'\\]"):
            mesh.get_global_rank({"DP": 1})
        with pytest.raises(ValueError, match="out of range on mesh dim 1"):
            mesh.get_global_rank((0, 4))
        with pytest.raises(ValueError, match="is taken"):
            mesh.flatten(("DP", "TP"), "TP")
    with pytest.raises(RuntimeError, match="not initialized"):
        ParallelMesh().get_strategy_coordinate()


def test_float_sizes_and_a_string_of_names_are_refused_not_reinterpreted():
    """(2.0, 2.5) used to be truncated to (2, 2), and "DT" split into ("D", "T")."""
    with fake_world(4):
        for shape in ((2.0, 2.5), (2, 2.0), (True, 4), "22", 4):
            with pytest.raises(TypeError, match=r"mesh_shape .*must be|each size must be an int"):
                init_device_mesh("cpu", shape)
        with pytest.raises(TypeError, match=r"\(2.0, 2.5\) holds 2.0: each size must be an int"):
            init_device_mesh("cpu", (2.0, 2.5))
        with pytest.raises(TypeError, match=r"mesh_dim_names='DT' is one string.*\('D', 'T'\) or \('DP', 'TP'\)"):
            init_device_mesh("cpu", (2, 2), mesh_dim_names="DT")
        with pytest.raises(TypeError, match=r"\('DP',\)"):
            init_device_mesh("cpu", (4,), mesh_dim_names="DP")
        mesh = init_device_mesh("cpu", np.array([2, 2]), mesh_dim_names=["D", "T"])
        assert mesh.shape == (2, 2) and mesh.mesh_dim_names == ("D", "T")


def test_a_submesh_in_another_order_names_the_order_that_works():
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))
        with pytest.raises(KeyError, match=r"keeps the mesh's dim order \('PP', 'DP', 'TP'\); ask for mesh\['PP', 'TP'\]"):
            mesh["TP", "PP"]
        assert mesh["PP", "TP"].mesh_dim_names == ("PP", "TP")


@pytest.mark.parametrize("rank", [0, 13, 31])
def test_expert_parallel_is_a_role_like_the_others(rank):
    """``"EP"`` is a mesh role (``ROLE_DIMS``, ``EXPERT_DIM``) with its getters; a mesh without it has an
    EP size of one: rank 0, no mesh, no group."""
    from ndweave.mesh import EXPERT_DIM, ROLE_DIMS

    assert EXPERT_DIM == ROLE_DIMS["expert"] == "EP"
    with fake_world(32, rank=rank):
        mesh = init_device_mesh("cpu", (2, 2, 4, 2), mesh_dim_names=("PP", "DP", "EP", "TP"))
        pp, dp, ep, tp = rank // 16, (rank // 8) % 2, (rank // 2) % 4, rank % 2
        assert (mesh.get_expert_parallel_rank(), mesh.get_data_parallel_rank()) == (ep, dp)
        assert mesh.get_expert_parallel_mesh().mesh.tolist() == [16 * pp + 8 * dp + 2 * i + tp for i in range(4)]
        assert mesh.get_expert_parallel_group() is mesh.get_group("EP")
    with fake_world(4, rank=1):
        dense = init_device_mesh("cpu", (2, 2))
        assert dense.get_expert_parallel_rank() == 0
        assert dense.get_expert_parallel_mesh() is None and dense.get_expert_parallel_group() is None


@pytest.mark.parametrize("rank", [0, 9, 15])
def test_context_parallel_is_a_role_like_the_others(rank):
    """``"CP"`` is a mesh role (``ROLE_DIMS``, ``CONTEXT_DIM``) with its getters; size one without it."""
    from ndweave.mesh import CONTEXT_DIM, ROLE_DIMS

    assert CONTEXT_DIM == ROLE_DIMS["context"] == "CP"
    with fake_world(16, rank=rank):
        mesh = init_device_mesh("cpu", (2, 4, 2), mesh_dim_names=("DP", "CP", "TP"))
        dp, cp, tp = rank // 8, (rank // 2) % 4, rank % 2
        assert (mesh.get_context_parallel_rank(), mesh.get_data_parallel_rank()) == (cp, dp)
        assert mesh.get_context_parallel_mesh().mesh.tolist() == [8 * dp + 2 * i + tp for i in range(4)]
        assert mesh.get_context_parallel_group() is mesh.get_group("CP")
    with fake_world(4, rank=1):
        dense = init_device_mesh("cpu", (2, 2))
        assert dense.get_context_parallel_rank() == 0
        assert dense.get_context_parallel_mesh() is None and dense.get_context_parallel_group() is None
