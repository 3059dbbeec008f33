"""Checking a state dict against the optimizer that loads it, with one verdict on every rank.

``DistributedOptimizer.load_state_dict`` ends in collectives (the parameter all-gathers). A state
dict from another model (other FQNs, other shapes) used to load nothing and say nothing; raising on
the ranks that notice while the others enter the all-gather would hang them. So every rank checks
locally, then the ranks exchange their findings (``ndweave.mesh.agree.raise_on_every_rank``) and all raise the
same error, naming each mismatch and the rank that found it, before any other collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ndweave.mesh.contracts import MASTER_KEY, StatePiece

__all__ = ["LOAD_FIX", "StateDictMismatchError", "state_dict_mismatches"]


class StateDictMismatchError(ValueError):
    """The state dict does not fit the optimizer (raised on every rank, naming each mismatch)."""


#: What to do about a :class:`StateDictMismatchError`, said after the mismatches.
LOAD_FIX = ("Load a state dict saved by an optimizer over the same model (same FQNs and shapes), or pass strict=False "
            "to load only the entries that match by name")


def _global_shape(value: Any) -> tuple[int, ...] | None:
    """The global shape a stored master weight describes: a piece's layout, or a full tensor's shape."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], StatePiece):
        value = value[0]
    if isinstance(value, StatePiece):
        return tuple(value.layout.global_shape)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _sharded_value(entry: Mapping[str, Any]) -> Any:
    """The entry's master weights, or without them (``state_dict(format="dcp")`` of an fp32 model) its
    first piece: what tells the global shape."""
    if MASTER_KEY in entry:
        return entry[MASTER_KEY]
    return next((v for v in entry.values() if _global_shape(v) is not None and not isinstance(v, torch.Tensor)), None)


def state_dict_mismatches(state_dict: Mapping[str, Any], num_groups: int, shapes: Mapping[str, tuple[int, ...]],
                          needed: Sequence[str], *, strict: bool = True) -> list[str]:
    """What keeps ``state_dict`` from loading: the number of param groups, an entry for every FQN this
    rank holds a shard of (``needed``; ``strict``) and the global shapes of the FQNs in ``shapes``.

    FQNs of the state that this optimizer lacks are no error by themselves: a state gathered from
    every rank of another layout (other pipeline stages included) holds more than one rank needs."""
    if not isinstance(state_dict, Mapping) or not {"param_groups", "state"} <= set(state_dict):
        return [f"not an optimizer state dict (a dict with 'param_groups' and 'state'): got {type(state_dict).__name__}"]
    problems = []
    groups, state = state_dict["param_groups"], state_dict["state"]
    if len(groups) != num_groups:
        problems.append(f"the state has {len(groups)} param groups, the optimizer {num_groups}")
    absent = [n for n in needed if n not in state]
    if strict and absent:
        foreign = [n for n in state if n not in shapes]
        hint = f"; the state's FQNs this optimizer lacks: {_some(foreign)}" if foreign else ""
        problems.append(f"no state for this optimizer's parameters {_some(absent)}{hint}")
    for fqn, entry in state.items():
        shape = _global_shape(_sharded_value(entry)) if isinstance(entry, Mapping) else None
        if fqn in shapes and shape is not None and shape != shapes[fqn]:
            problems.append(f"{fqn!r}: global shape {list(shape)} in the state, {list(shapes[fqn])} in the model")
    return problems


def _some(names: Sequence[str], limit: int = 8) -> str:
    """A list of names, cut after ``limit`` (with how many more)."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{list(names[:limit])}{more}"
