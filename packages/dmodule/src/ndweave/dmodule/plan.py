"""Sharding plans: parsing keys, matching them against a module tree, checking placements.

A plan is ``{"parameter": {...}, "forward": {...}, "patch": {...}}``. Keys of the first two are
``<regex over module FQN>.<leaf>``: the regex must match a module's fully qualified name entirely
(``re.fullmatch``; the root module's FQN is ``""``), the leaf is a parameter/buffer name, or ``input``
/ ``output`` (forward only). Everything here is pure bookkeeping: no tensor is touched.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ndweave.mesh.contracts import removed_modules
from ndweave.mesh.torch_compat import StridedShard, chunk_sizes, is_shard_like

__all__ = [
    "PlacementSpec", "Plan", "PlanKeyError", "normalize_plan", "match_modules", "names_removed_module",
    "check_placements", "IO_LEAVES", "plan_tree", "plan_specs", "suggest",
]

IO_LEAVES = ("input", "output")
_SECTIONS = ("parameter", "forward", "patch")


class PlanKeyError(KeyError, ValueError):
    """A plan names something that is not there: a section, a module, a forward argument, an output
    field, a module class. A ``KeyError`` as veScale raises (and users' ``except KeyError`` expects),
    and a ``ValueError`` as ndweave raised before, so both kinds of handler keep working."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument: quoted and escaped
        return Exception.__str__(self)


def suggest(name: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the nearest candidate, or ``""``."""
    near = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""


@dataclass(frozen=True)
class PlacementSpec:
    """Placements plus options, usable anywhere a plan takes a list of placements.

    - ``placements``: one ``Shard``/``Replicate``/``Partial`` per mesh dim (parameter plans also
      take ``_StridedShard(dim, split_factor=f)``: a fused [q | k | v] weight, rank r holding its
      own [q_r | k_r | v_r]).
    - ``async_op``: launch the redistribution asynchronously (the result waits on first use).
    - ``grad_placements``: for outputs returned as local tensors, the layout their gradient has
      (passed to ``DTensor.to_local(grad_placements=...)``); default: same as ``placements``.
    - ``to_local``: on an output, redistribute to ``placements`` then hand back the plain local
      tensor (how attention stays on local heads: q/k/v outputs ``PlacementSpec([Shard(-1)],
      to_local=True)``, the output projection's input ``[[Shard(-1)]]``).
    """

    placements: tuple[Placement, ...]
    async_op: bool = False
    grad_placements: tuple[Placement, ...] | None = None
    to_local: bool = False

    def __init__(self, placements: Sequence[Placement], *, async_op: bool = False,
                 grad_placements: Sequence[Placement] | None = None, to_local: bool = False) -> None:
        object.__setattr__(self, "placements", tuple(placements))
        object.__setattr__(self, "async_op", async_op)
        object.__setattr__(self, "grad_placements", None if grad_placements is None else tuple(grad_placements))
        object.__setattr__(self, "to_local", to_local)


PlacementsLike = Union[PlacementSpec, Sequence[Placement]]
Patch = Union[str, Callable[[nn.Module, DeviceMesh, str], None]]


def as_spec(value: Any) -> PlacementSpec | None:
    """A plan value (``PlacementSpec``, list of placements, or ``None``) as a ``PlacementSpec``."""
    if value is None or isinstance(value, PlacementSpec):
        return value
    if isinstance(value, Placement):
        return PlacementSpec([value])
    if isinstance(value, Sequence) and all(isinstance(p, Placement) for p in value):
        return PlacementSpec(value)
    raise TypeError(f"expected a list of placements or a PlacementSpec, got {value!r}")


@dataclass
class Plan:
    """A normalized plan: raw keys split into (regex, leaf), values normalized."""

    parameter: dict[str, PlacementSpec]
    forward: dict[str, Any]
    patch: dict[str, list[Patch]]


def normalize_plan(sharding_plan: Mapping | None, param_sharding_plan: Mapping | None,
                   fwd_resharding_plan: Mapping | None, patches: Mapping | None) -> Plan:
    """Merge the three ways of passing a plan into one :class:`Plan`; later sources win per key."""
    sharding_plan = dict(sharding_plan or {})
    for section in sharding_plan:
        if section not in _SECTIONS:
            raise PlanKeyError(
                f"sharding_plan has an unknown section {section!r}{suggest(str(section), _SECTIONS)} "
                f"(the sections are {list(_SECTIONS)})"
            )
    parameter = {**(sharding_plan.get("parameter") or {}), **(param_sharding_plan or {})}
    forward = {**(sharding_plan.get("forward") or {}), **(fwd_resharding_plan or {})}
    patch: dict[str, list[Patch]] = {}
    for source in (sharding_plan.get("patch") or {}, patches or {}):
        for key, value in source.items():
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            patch.setdefault(key, []).extend(items)
    return Plan(
        parameter={k: as_spec(v) for k, v in parameter.items()},
        forward={k: _normalize_forward_value(k, v) for k, v in forward.items()},
        patch=patch,
    )


def _normalize_forward_value(key: str, value: Any) -> Any:
    _, leaf = split_key(key)
    if leaf not in IO_LEAVES:
        return as_spec(value)  # a weight redistributed before forward
    tree = plan_tree(value)
    if not isinstance(tree, (list, dict)):
        raise TypeError(
            f"forward plan {key!r}: give one placements list per {leaf}, e.g. [[Replicate()]], or a dict by "
            f"name, e.g. {{'x': [Replicate()]}}, not {value!r}"
        )
    return tree


def plan_tree(value: Any) -> Any:
    """A forward plan value, normalized: ``None``, a :class:`PlacementSpec` (a list of placements),
    a dict of plan values (by argument or field name) or a list of them (by position); nested
    values follow the nesting of the inputs/outputs they lay out."""
    if value is None or isinstance(value, (PlacementSpec, Placement)):
        return as_spec(value)
    if isinstance(value, Mapping):
        return {name: plan_tree(v) for name, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        if value and all(isinstance(p, Placement) for p in value):
            return as_spec(value)
        return [plan_tree(v) for v in value]
    raise TypeError(f"expected a list of placements, a PlacementSpec, None, or a list/dict of them, got {value!r}")


def plan_specs(tree: Any) -> Iterator[PlacementSpec]:
    """Every :class:`PlacementSpec` in a normalized plan value."""
    if isinstance(tree, PlacementSpec):
        yield tree
    elif isinstance(tree, (list, dict)):
        for v in tree.values() if isinstance(tree, dict) else tree:
            yield from plan_specs(v)


def split_key(key: str) -> tuple[str, str]:
    """``"layers\\.\\d+\\.mlp.weight"`` -> (``"layers\\.\\d+\\.mlp"``, ``"weight"``); no dot -> root."""
    if "." not in key:
        return "", key
    regex, leaf = key.rsplit(".", 1)
    if regex.endswith("\\") and not regex.endswith("\\\\"):
        regex = regex[:-1]  # "fc1\.weight": the escaped dot is the separator
    return regex, leaf


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
    stage removed from ``root``: such a key matching nothing is expected, not a typo."""
    removed = removed_modules(root)
    if key.startswith("class:"):
        return key[len("class:"):] in removed.values()
    pattern = re.compile(key)
    return any(pattern.fullmatch(fqn) for fqn in removed)


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
