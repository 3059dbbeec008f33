"""Sharding plans against a module: matching plan keys to modules, checking placements against
tensors and the mesh. (The plan as data, keys and values: ``spec.py``.) No tensor is changed here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ndweave.dmodule.spec import PlacementSpec, PlanKeyError
from ndweave.mesh.contracts import removed_modules
from ndweave.mesh.torch_compat import StridedShard, chunk_sizes, is_shard_like

__all__ = ["check_placements", "match_modules", "mesh_str", "names_removed_module", "no_match_error"]


def match_modules(root: nn.Module, regex: str, key: str | None = None) -> list[tuple[str, nn.Module]]:
    """Modules of ``root`` (shared ones under each of their FQNs) whose FQN ``regex`` fully matches."""
    key = regex if key is None else key
    try:
        pattern = re.compile(regex)
    except re.error as err:
        raise ValueError(f"plan key {key!r}: {regex!r} is not a valid regular expression ({err})") from None
    removed = removed_modules(root)  # a pipeline stage's placeholders stand where other stages' layers were
    return [(fqn, m) for fqn, m in root.named_modules(remove_duplicate=False)
            if pattern.fullmatch(fqn) and fqn not in removed]


def names_removed_module(root: nn.Module, key: str) -> bool:
    """Whether plan key ``key`` (a module regex, or ``class:<Name>``) names a module that a pipeline
    stage removed from ``root``, or one inside it (``h\\.\\d+\\.mlp\\.experts`` where the stage
    removed ``h.0``: a prefix of the key's dotted path names it): such a key matching nothing is
    expected, not a typo."""
    removed = removed_modules(root)
    if key.startswith("class:"):
        return key[len("class:"):] in removed.values()
    return any(pattern.fullmatch(fqn) for pattern in _path_prefixes(key) for fqn in removed)


def _path_prefixes(key: str) -> list[re.Pattern]:
    """The regexes of ``key``'s dotted path and each of its leading parts (split at ``\\.`` or ``.``;
    a part that does not compile alone is skipped)."""
    parts = re.split(r"\\\.|\.(?![*+?{])", key)
    out = []
    for i in range(1, len(parts) + 1):
        try:
            out.append(re.compile(r"\.".join(parts[:i])))
        except re.error:
            continue
    return out


def no_match_error(section: str, key: str, candidates: Iterable[str]) -> PlanKeyError:
    candidates = sorted(set(candidates))
    plain = key.replace("\\", "")
    near = difflib.get_close_matches(plain, candidates, n=5, cutoff=0.4)
    hint = f"; nearest: {near}" if near else f"; some candidates: {candidates[:8]}"
    return PlanKeyError(f"{section} plan key {key!r} matches nothing in the module{hint}")


def check_placements(spec: PlacementSpec, tensor: torch.Tensor, mesh: DeviceMesh, what: str) -> tuple[Placement, ...]:
    """Validate ``spec`` for ``tensor`` on ``mesh``; return placements with shard dims made non-negative."""
    placements = spec.placements
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{what}: {len(placements)} placements {list(placements)} for a {mesh.ndim}-D mesh {mesh_str(mesh)}; "
            "give one placement per mesh dim"
        )
    out = []
    for p in placements:
        # a strided shard's dim is checked and normalized exactly like Shard's
        if is_shard_like(p):
            if not -tensor.ndim <= p.dim < tensor.ndim:  # (a 0-D tensor has no dim to shard)
                raise ValueError(
                    f"{what}: {p!r} is out of range for a {tensor.ndim}-D tensor of shape {tuple(tensor.shape)} "
                    f"on mesh {mesh_str(mesh)}"
                )
            if isinstance(p, StridedShard):
                if int(p.split_factor) < 1:
                    raise ValueError(f"{what}: {p!r} needs split_factor >= 1 (on mesh {mesh_str(mesh)})")
                p = StridedShard(p.dim % tensor.ndim, split_factor=p.split_factor)
            else:
                p = Shard(p.dim % tensor.ndim)
        elif not isinstance(p, (Replicate, Partial)):
            raise TypeError(f"{what}: unsupported placement {p!r} on mesh {mesh_str(mesh)}")
        out.append(p)
    _check_strided_shards_even(out, tensor, mesh, what)
    return tuple(out)


def _check_strided_shards_even(placements: list[Placement], tensor: torch.Tensor, mesh: DeviceMesh,
                               what: str) -> None:
    """Refuse a ``_StridedShard`` whose ranks would get pieces of different sizes.

    torch's ``distribute_tensor`` (and its scatter) needs equal pieces there and fails with a bare
    ``AssertionError`` otherwise; deferred init would quietly build them. Sizes are followed mesh dim
    by mesh dim (an earlier ``Shard`` of the same tensor dim changes what the strided one splits),
    with torch's own chunking run on an ``arange`` of each size.
    """
    if not any(isinstance(p, StridedShard) for p in placements):
        return
    sizes: dict[int, set[int]] = {}  # tensor dim -> the sizes it can have on some rank, so far
    for mesh_dim, p in enumerate(placements):
        if not is_shard_like(p):
            continue
        n = mesh.size(mesh_dim)
        after: set[int] = set()
        for size in sorted(sizes.get(p.dim, {tensor.shape[p.dim]})):
            pieces = chunk_sizes(p, size, n)
            if isinstance(p, StridedShard) and len(set(pieces)) > 1:
                raise ValueError(
                    f"{what}: {p!r} on mesh dim {mesh_dim} splits a size-{size} dim into pieces of {pieces} over "
                    f"{n} ranks of {mesh_str(mesh)}; torch's _StridedShard needs equal pieces: make it a "
                    f"multiple of split_factor * {n}"
                )
            after.update(pieces)
        sizes[p.dim] = after


def mesh_str(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return f"DeviceMesh({mesh.device_type}, {dict(zip(names, mesh.shape))})"
