"""Pure rank <-> coordinate arithmetic over a mesh's rank grid.

Kept free of process groups so it can be checked at any logical size (64 ranks, 4 dims) in one
process, and so every rank can answer questions about *other* ranks without communication.
The grid is the ``DeviceMesh.mesh`` tensor: ``grid[c0, c1, ...]`` is the global rank at coordinate
``(c0, c1, ...)``. Nothing here assumes ranks are laid out ``arange(world).view(shape)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "coordinate_of",
    "rank_at",
    "index_along",
    "groups_along",
    "rank_with_index_along",
]


def coordinate_of(grid: np.ndarray, rank: int) -> tuple[int, ...]:
    """The coordinate of global ``rank`` in ``grid``; ``ValueError`` if the mesh lacks it."""
    hits = np.argwhere(grid == rank)
    if len(hits) == 0:
        raise ValueError(f"rank {rank} is not in this mesh (its ranks are {sorted(grid.flatten().tolist())})")
    return tuple(int(c) for c in hits[0])


def rank_at(grid: np.ndarray, coordinate: Sequence[int]) -> int:
    """The global rank at ``coordinate``, with a bounds check that names the offending dim."""
    if len(coordinate) != grid.ndim:
        raise ValueError(f"coordinate {tuple(coordinate)} has {len(coordinate)} entries but the mesh has {grid.ndim} dims")
    for axis, c in enumerate(coordinate):
        # numpy would take a float (IndexError) or a bool (a mask) and answer something unreadable or wrong
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise TypeError(f"coordinate {tuple(coordinate)}: the index on mesh dim {axis} is {c!r} "
                            f"({type(c).__name__}); mesh coordinates are ints")
    for axis, (c, n) in enumerate(zip(coordinate, grid.shape)):
        if not 0 <= c < n:
            raise ValueError(f"coordinate {tuple(coordinate)} is out of range on mesh dim {axis} (size {n})")
    return int(grid[tuple(coordinate)])


def index_along(grid: np.ndarray, rank: int, dims: Sequence[int]) -> int:
    """Row-major index of ``rank`` within the (possibly flattened) group spanned by ``dims``."""
    coord = coordinate_of(grid, rank)
    index = 0
    for d in dims:
        index = index * grid.shape[d] + coord[d]
    return index


def groups_along(grid: np.ndarray, dims: Sequence[int]) -> list[list[int]]:
    """Every group of ranks that differ only in ``dims`` (one list per sibling submesh).

    The ranks inside a group are ordered by their row-major index along ``dims``, which is the order
    torch's ``DeviceMesh`` gives the same group, so ``groups[i][j]`` is "submesh i, local rank j".
    """
    others = [d for d in range(grid.ndim) if d not in dims]
    moved = np.transpose(grid, others + list(dims))
    size = int(np.prod([grid.shape[d] for d in dims])) if dims else 1
    return moved.reshape(-1, size).tolist()


def rank_with_index_along(grid: np.ndarray, rank: int, dims: Sequence[int], index: int) -> int:
    """The rank that shares ``rank``'s coordinates off ``dims`` and has row-major ``index`` along them."""
    coord = list(coordinate_of(grid, rank))
    for d in reversed(dims):
        coord[d] = index % grid.shape[d]
        index //= grid.shape[d]
    return int(grid[tuple(coord)])
