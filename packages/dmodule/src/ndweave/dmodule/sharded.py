"""``is_model_sharded=True``: global shapes from every rank's local shards, checked against the plan.

Each rank holds its own piece of every planned tensor. The pieces must be the ones DTensor itself
would cut from one global tensor (torch's chunking: the first pieces the larger), or every later
redistribution pads and gathers the wrong rows. Every rank checks every rank's shapes (gathered once
by ``ndweave.mesh.agree.agree_or_raise``), so a wrong shard raises the same error on all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from ndweave.mesh.agree import RankMismatchError
from ndweave.mesh.torch_compat import chunk_sizes, is_shard_like

__all__ = ["sharded_global_shapes"]


class _Sharded(Protocol):
    name: str
    placements: tuple
    local_shard: bool


def sharded_global_shapes(mesh: DeviceMesh, layouts: Iterable[_Sharded],
                          local_shapes: dict[int, dict[str, tuple[int, ...]]]) -> dict[str, torch.Size]:
    """Each local shard's global shape (by tensor name), from every mesh rank's local shapes; raises
    :class:`RankMismatchError` naming the tensor, the rank, and the expected and got local shapes."""
    grid = mesh.mesh
    ranks = {index: int(grid[index]) for index in itertools.product(*map(range, grid.shape))}  # coordinate -> rank
    sizes: dict[tuple[Any, int, int], list[int]] = {}  # chunking is the same for many tensors: once each

    def chunked(p: Any, size: int, n: int) -> list[int]:
        key = (p, size, n)
        if key not in sizes:
            sizes[key] = chunk_sizes(p, size, n)
        return sizes[key]

    out = {}
    for x in layouts:
        if not x.local_shard:
            continue
        shapes = {c: local_shapes[rank][x.name] for c, rank in ranks.items()}
        ndim = len(next(iter(shapes.values())))
        sharding = [{d for d, p in enumerate(x.placements) if is_shard_like(p) and p.dim == k} for k in range(ndim)]
        # a tensor dim's global size: its pieces along the mesh dims that shard it, the others at 0
        full = [sum(shape[k] for c, shape in shapes.items() if all(c[d] == 0 for d in range(mesh.ndim) if d not in sharding[k]))
                for k in range(ndim)]
        for c in sorted(shapes, key=ranks.__getitem__):
            expected = list(full)
            for d, p in enumerate(x.placements):
                if is_shard_like(p):
                    expected[p.dim] = chunked(p, expected[p.dim], mesh.size(d))[c[d]]
            if tuple(expected) != tuple(shapes[c]):
                raise RankMismatchError(
                    f"parallelize_module(is_model_sharded=True): {x.name!r} with placements {list(x.placements)} "
                    f"has local shape {tuple(shapes[c])} on rank {ranks[c]}, expected {tuple(expected)}: the "
                    f"ranks' shards add up to a global shape {tuple(full)}, which DTensor splits into other "
                    "pieces; give each rank the piece distribute_tensor would (torch's chunking, the first "
                    "pieces the larger), or fix the plan's placements for it"
                )
        out[x.name] = torch.Size(full)
    return out
