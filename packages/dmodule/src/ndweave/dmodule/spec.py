"""Sharding plans as data: ``PlacementSpec``, plan keys and values, normalized into a :class:`Plan`.

A plan is ``{"parameter": {...}, "forward": {...}, "patch": {...}}``. Keys of the first two are
``<regex over module FQN>.<leaf>``: the regex must match a module's fully qualified name entirely
(``re.fullmatch``; the root module's FQN is ``""``), the leaf is a parameter/buffer name, or ``input``
/ ``output`` (forward only). A leaf: no module or tensor is looked at here, so the core
(``api.py``), the zoo (``plans/``) and plan files (``plans/serialization.py``) all build on it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "IO_LEAVES", "SECTIONS", "PlacementSpec", "PlacementsLike", "Plan", "PlanKeyError", "as_spec",
    "normalize_plan", "plan_specs", "plan_tree", "split_key", "suggest",
]

IO_LEAVES = ("input", "output")
SECTIONS = ("parameter", "forward", "patch")


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


def as_spec(value: Any, where: str = "a plan value") -> PlacementSpec | None:
    """A plan value (``PlacementSpec``, list of placements, or ``None``) as a ``PlacementSpec``;
    ``where`` names the entry in errors (``"parameter plan 'fc1.weight'"``)."""
    if value is None or isinstance(value, PlacementSpec):
        return value
    if isinstance(value, Placement):
        return PlacementSpec([value])
    if isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(p, Placement) for p in value):
        return PlacementSpec(value)
    _refuse_strings(value, where, nesting=1)
    raise TypeError(f"{where}: expected a list of placements or a PlacementSpec, got {value!r}")


@dataclass
class Plan:
    """A normalized plan: every value checked and in one form."""

    parameter: dict[str, PlacementSpec]
    """Key -> the tensor's placements."""
    forward: dict[str, Any]
    """Key -> a :func:`plan_tree` (inputs, outputs) or a ``PlacementSpec`` (a weight)."""
    patch: dict[str, list[Any]]
    """Key (FQN regex or ``class:<Name>``) -> patch entries, as given (see ``patches.py``)."""


def normalize_plan(sharding_plan: Mapping | None, param_sharding_plan: Mapping | None,
                   fwd_resharding_plan: Mapping | None, patches: Mapping | None) -> Plan:
    """Merge the three ways of passing a plan into one :class:`Plan`; later sources win per key."""
    sharding_plan = dict(sharding_plan or {})
    for section in sharding_plan:
        if section not in SECTIONS:
            raise PlanKeyError(
                f"sharding_plan has an unknown section {section!r}{suggest(str(section), SECTIONS)} "
                f"(the sections are {list(SECTIONS)})"
            )
    parameter = {**(sharding_plan.get("parameter") or {}), **(param_sharding_plan or {})}
    forward = {**(sharding_plan.get("forward") or {}), **(fwd_resharding_plan or {})}
    patch: dict[str, list[Any]] = {}
    for source in (sharding_plan.get("patch") or {}, patches or {}):
        for key, value in source.items():
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            patch.setdefault(key, []).extend(items)
    return Plan(
        parameter={k: as_spec(v, f"parameter plan {k!r}") for k, v in parameter.items()},
        forward={k: _normalize_forward_value(k, v) for k, v in forward.items()},
        patch=patch,
    )


def _normalize_forward_value(key: str, value: Any) -> Any:
    _, leaf = split_key(key)
    where = f"forward plan {key!r}"
    if leaf not in IO_LEAVES:
        return as_spec(value, where)  # a weight redistributed before forward
    _refuse_strings(value, where, nesting=2)  # one placements list per input / output
    tree = plan_tree(value, where)
    if not isinstance(tree, (list, dict)):
        raise TypeError(
            f"{where}: give one placements list per {leaf}, e.g. [[Replicate()]], or a dict by "
            f"name, e.g. {{'x': [Replicate()]}}, not {value!r}"
        )
    return tree


def plan_tree(value: Any, where: str = "a plan value") -> Any:
    """A forward plan value, normalized: ``None``, a :class:`PlacementSpec` (a list of placements),
    a dict of plan values (by argument or field name) or a list of them (by position); nested
    values follow the nesting of the inputs/outputs they lay out."""
    if value is None or isinstance(value, (PlacementSpec, Placement)):
        return as_spec(value, where)
    if isinstance(value, Mapping):
        return {name: plan_tree(v, f"{where}[{name!r}]") for name, v in value.items()}
    _refuse_strings(value, where, nesting=1)
    if isinstance(value, Sequence) and not isinstance(value, str):
        if value and all(isinstance(p, Placement) for p in value):
            return as_spec(value, where)
        return [plan_tree(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where}: expected a list of placements, a PlacementSpec, None, or a list/dict of them, "
                    f"got {value!r}")


def _refuse_strings(value: Any, where: str, nesting: int) -> None:
    """Placements written as strings (``"Shard(0)"``, or JSON's ``"Replicate"`` in a Python plan) are
    refused with the fix spelled out: the placement objects, nested as this place of the plan takes
    them (``nesting`` lists deep)."""
    if isinstance(value, str):
        items, what = [value], "is a string, not a placement"
    elif (isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value)
          and all(isinstance(v, (str, Placement)) for v in value)):
        items, what = value, "holds strings, not placements"
    else:
        return
    written = ", ".join(_placement_text(v) if isinstance(v, str) else repr(v) for v in items)
    raise TypeError(
        f"{where}: {value!r} {what}; write {'[' * nesting}{written}{']' * nesting} "
        "(from torch.distributed.tensor import Shard, Replicate, Partial); a JSON plan file spells them "
        "\"Replicate\", {\"Shard\": 0}, ... and is read with ndweave.dmodule.load_plan"
    )


def _placement_text(text: str) -> str:
    """``"Replicate"`` (JSON's spelling) -> ``"Replicate()"``; ``"Shard(0)"`` as written."""
    text = text.strip()
    return f"{text}()" if text in ("Replicate", "Partial") else text


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
