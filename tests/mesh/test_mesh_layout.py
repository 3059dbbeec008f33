"""Rank arithmetic on rank grids, including grids not laid out arange(world)."""

import numpy as np
import pytest

from ndweave.mesh import layout


def test_coordinates_round_trip_on_a_4d_grid():
    grid = np.arange(2 * 3 * 2 * 2).reshape(2, 3, 2, 2)
    for rank in range(grid.size):
        coord = layout.coordinate_of(grid, rank)
        assert layout.rank_at(grid, coord) == rank
    assert layout.coordinate_of(grid, 17) == (1, 1, 0, 1)


def test_groups_along_one_and_several_dims():
    grid = np.arange(8).reshape(2, 2, 2)  # PP, DP, TP
    assert layout.groups_along(grid, [2]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups_along(grid, [1]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups_along(grid, [0]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups_along(grid, [1, 2]) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_permuted_grid_uses_the_grid_not_arange():
    grid = np.array([[3, 1], [0, 2]])
    assert layout.coordinate_of(grid, 0) == (1, 0)
    assert layout.index_along(grid, 2, [1]) == 1
    assert layout.rank_with_index_along(grid, 3, [0], 1) == 0
    assert layout.groups_along(grid, [1]) == [[3, 1], [0, 2]]


def test_index_along_flattened_dims_is_row_major():
    grid = np.arange(8).reshape(2, 2, 2)
    assert [layout.index_along(grid, r, [0, 2]) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert layout.rank_with_index_along(grid, 2, [0, 2], 3) == 7


def test_bad_coordinates_name_the_problem():
    grid = np.arange(4).reshape(2, 2)
    with pytest.raises(ValueError, match="out of range on mesh dim 1"):
        layout.rank_at(grid, (0, 2))
    with pytest.raises(ValueError, match="has 3 entries but the mesh has 2 dims"):
        layout.rank_at(grid, (0, 0, 0))
    with pytest.raises(ValueError, match="rank 9 is not in this mesh"):
        layout.coordinate_of(grid, 9)
    # a float (numpy's IndexError) or a bool (a mask: a wrong rank, silently) is named instead
    with pytest.raises(TypeError, match=r"index on mesh dim 1 is 1.0 \(float\); mesh coordinates are ints"):
        layout.rank_at(grid, (0, 1.0))
    with pytest.raises(TypeError, match="index on mesh dim 0 is True"):
        layout.rank_at(grid, (True, 0))
    assert layout.rank_at(grid, (np.int64(1), 1)) == 3
