"""Agreement across the ranks of a mesh before a collective: every rank raises the same error, none waits.

A user mistake seen by one rank only (a plan that differs by rank, a model built from another config,
a rank-dependent input shape) would otherwise make that rank raise while the others block in the
next collective until the process-group timeout. Here each rank validates locally, then the ranks
exchange a small payload (their fingerprint, or the error they hit) over the mesh, so every rank sees
every rank's outcome and raises the same error, naming the rank that differs.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Coordinate", "RankMismatchError", "gather_over_mesh", "ranks_by_coordinate", "validate_on_every_rank"]

T = TypeVar("T")
Coordinate = tuple[int, ...]


class RankMismatchError(ValueError):
    """Ranks of one mesh disagree on what they were given (a plan, a model, a shape); raised on every rank."""


def gather_over_mesh(mesh: DeviceMesh, value: Any) -> dict[Coordinate, Any]:
    """Every mesh rank's ``value``, by mesh coordinate, on every mesh rank.

    One ``all_gather_object`` per mesh dim, each on that dim's group: after dim d a rank holds the
    values of every rank that differs from it only in dims 0..d, so after the last dim it holds all.
    (No single process group spans an nD submesh; its dims' groups do.) Outside a process group,
    or on a one-rank mesh, only this rank's value.
    """
    coordinate = mesh.get_coordinate()
    table = {tuple(coordinate): value}
    if not dist.is_initialized():
        return table
    for mesh_dim in range(mesh.ndim):
        if mesh.size(mesh_dim) == 1:
            continue
        parts: list[Any] = [None] * mesh.size(mesh_dim)
        dist.all_gather_object(parts, table, group=mesh.get_group(mesh_dim))
        table = {c: v for part in parts for c, v in part.items()}
    return table


def validate_on_every_rank(mesh: DeviceMesh, what: str, validate: Callable[[], tuple[T, dict[str, Any]]],
                           hint: str = "") -> tuple[T, dict[Coordinate, Any]]:
    """Run ``validate()`` (local checks, no collectives) on every rank of ``mesh`` and agree on the outcome.

    ``validate`` returns ``(result, fingerprint)``: ``fingerprint`` is a small dict of picklable
    values every rank must hold equal (e.g. ``{"plan": ..., "tensors": ...}``), plus entries under
    ``"local"`` that may differ (gathered, not compared). Returns this rank's ``result`` and every
    rank's ``fingerprint["local"]`` by mesh coordinate. If any rank raised, every rank raises that
    error (its type, the rank named); if fingerprints differ, every rank raises
    :class:`RankMismatchError` naming the first entry that differs and the ranks on each side, then
    ``hint`` (the fix; default: pass every rank the same).
    """
    if mesh.get_coordinate() is None:  # not in the mesh: nothing to agree with
        return validate()[0], {}
    try:
        result, fingerprint = validate()
        shared = {k: v for k, v in fingerprint.items() if k != "local"}
        # a digest travels, not the fingerprint: a few bytes per rank unless the ranks differ
        payload: Any = ("ok", hashlib.sha256(repr(shared).encode()).hexdigest(), fingerprint.get("local"))
    except Exception as error:  # noqa: BLE001 - sent to every rank, raised there
        result, payload, own = None, ("error", type(error), str(error)), error
    else:
        own = None
    everyone = gather_over_mesh(mesh, payload)
    ranks = ranks_by_coordinate(mesh)
    failed = sorted((ranks[c], p) for c, p in everyone.items() if p[0] == "error")
    if failed:
        rank, (_, cls, message) = failed[0]
        raise _rebuild(cls, f"{what} failed on rank {rank}"
                            f"{f' (and ranks {[r for r, _ in failed[1:]]})' if len(failed) > 1 else ''}: {message}") from own
    if len({p[1] for p in everyone.values()}) > 1:  # every rank sees this: every rank gathers again
        by_rank = sorted((ranks[c], p) for c, p in gather_over_mesh(mesh, shared).items())
        first_rank, first = by_rank[0]
        for rank, other in by_rank[1:]:
            for key in first:
                if other.get(key) != first[key]:
                    raise RankMismatchError(
                        f"{what}: rank {rank} was given another {key} than rank {first_rank}: "
                        f"{_difference(first[key], other.get(key), first_rank, rank)}; "
                        + (hint or f"every rank of the mesh must pass the same {key} (a rank-dependent value, "
                                   "e.g. a config read per rank?)")
                    )
    return result, {c: p[2] for c, p in everyone.items()}


def ranks_by_coordinate(mesh: DeviceMesh) -> dict[Coordinate, int]:
    grid = mesh.mesh
    return {index: int(grid[index]) for index in itertools.product(*map(range, grid.shape))}


def _difference(a: Any, b: Any, rank_a: int, rank_b: int) -> str:
    """The first differing entry of two fingerprint values (dicts: by key), for the message."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                return f"{key!r} is {a.get(key, '<absent>')} on rank {rank_a} but {b.get(key, '<absent>')} on rank {rank_b}"
    return f"{a} on rank {rank_a}, {b} on rank {rank_b}"


def _rebuild(cls: type, message: str) -> Exception:
    """The error a rank raised, rebuilt from its type and message (every rank raises this)."""
    try:
        error = cls(message)
        if isinstance(error, Exception) and str(error) == message:
            return error
    except Exception:  # noqa: BLE001 - a type that takes other arguments: fall back below
        pass
    return RuntimeError(f"{cls.__name__}: {message}")
