"""The optimizer state format: what a sharded optimizer's ``state_dict()`` holds, and how it turns
into full tensors, into the pieces another layout needs, and into ``torch.optim``'s format.

Owned by neither side: ``ndweave.optim`` writes it, ``ndweave.checkpoint`` stores it, users convert
it. Three forms of the same state:

* **sharded** (one rank's ``DistributedOptimizer.state_dict()``)::

      {"param_groups": [{"lr": ..., "params": ["layer.weight", ...]}, ...],
       "state": {"layer.weight": {"master_param": StatePiece, "exp_avg": StatePiece, "step": tensor(3.)}}}

  An entry is elementwise (a :class:`~ndweave.mesh.contracts.StatePiece` of the parameter, sharded
  like it) or a scalar the same on every rank (``step``): see :func:`is_elementwise`. A value may
  also be a list of pieces (several ranks', :func:`union_state_dicts`).
* **full**: every piece replaced by the tensor of the parameter's global shape
  (:func:`merge_state_dicts`, from every rank's sharded dicts of any layout).
* **torch**: what a single-device ``torch.optim`` optimizer loads (integer param ids, no master
  weights): :func:`to_torch_state_dict`, :func:`from_torch_state_dict`.

:func:`resolve_state_value` gives, from any of the first two forms, what one destination range needs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from ndweave.mesh.contracts.sharded_state import ShardLayout, StatePiece, merge_pieces, reshard_pieces, slice_piece

__all__ = [
    "MASTER_KEY",
    "SCALAR_KEYS",
    "from_torch_state_dict",
    "is_elementwise",
    "merge_state_dicts",
    "resolve_state_value",
    "to_torch_state_dict",
    "union_state_dicts",
]

#: Key of the (fp32 or wider) master weights in each parameter's state.
MASTER_KEY = "master_param"

#: State keys that are never elementwise, whatever their shape (a 0-d parameter's ``exp_avg`` and
#: its ``step`` would otherwise look alike).
SCALAR_KEYS = frozenset({"step"})


def is_elementwise(key: str, value: Any, shape: Sequence[int]) -> bool:
    """Whether state entry ``key`` is sharded like its parameter: a tensor of the parameter's
    ``shape`` (the held range's, or the global one in the full form) not named in :data:`SCALAR_KEYS`.
    Anything else is a scalar every rank holds alike."""
    return key not in SCALAR_KEYS and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape)


def _pieces(value: Any) -> list[StatePiece] | None:
    if isinstance(value, StatePiece):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, StatePiece) for v in value):
        return list(value)
    return None


def union_state_dicts(state_dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One sharded state dict holding every piece of ``state_dicts`` (lists of pieces), without
    building full tensors; scalars come from the first rank holding them."""
    if not state_dicts:
        raise ValueError("union_state_dicts needs at least one state dict")
    state: dict[str, dict[str, Any]] = defaultdict(dict)
    for sd in state_dicts:
        for fqn, entry in sd["state"].items():
            for key, value in entry.items():
                pieces = _pieces(value)
                if pieces is None:
                    state[fqn].setdefault(key, value)
                else:
                    state[fqn].setdefault(key, []).extend(pieces)
    return {"param_groups": [dict(g) for g in state_dicts[0]["param_groups"]], "state": dict(state)}


def merge_state_dicts(state_dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The **full** state from the sharded state dicts of every rank (any DP/TP layout); checks that
    every element is covered and that replicas agree (:func:`~ndweave.mesh.contracts.merge_pieces`)."""
    union = union_state_dicts(state_dicts)
    for entry in union["state"].values():
        for key, value in entry.items():
            pieces = _pieces(value)
            if pieces is not None:
                entry[key] = merge_pieces(pieces)
    return union


def resolve_state_value(value: Any, key: str, fqn: str, layout: ShardLayout, start: int,
                        end: int) -> tuple[Any, bool]:
    """``(value for [start, end) of fqn's local tensor laid out as layout, is_elementwise)`` from a
    stored value of any form: pieces of any layout, a full tensor, or a scalar (returned as is).
    Elementwise values come back flat."""
    pieces = _pieces(value)
    if pieces is not None:
        for p in pieces:  # the same layout and range: take it as is
            if (p.layout, p.start, p.end) == (layout, start, end):
                p.check()
                return p.data, True
        return reshard_pieces(pieces, layout, start, end).data, True
    if is_elementwise(key, value, layout.global_shape):
        return slice_piece(value, layout, start, end, fqn=fqn).data, True
    return value, False


def to_torch_state_dict(full: dict[str, Any], names: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """The **full** state as ``torch.optim.Optimizer.load_state_dict`` takes it.

    ``names[i]`` are the FQNs of the target optimizer's group ``i`` params, in its order (default:
    the FQN lists of ``full["param_groups"]``). Master weights are left out: load them into the model
    (``{fqn: entry[MASTER_KEY]}``).
    """
    groups = full["param_groups"]
    names = [g["params"] for g in groups] if names is None else names
    if len(names) != len(groups):
        raise ValueError(f"{len(names)} name lists for {len(groups)} param groups")
    state, out_groups, index = {}, [], 0
    for group, fqns in zip(groups, names):
        ids = []
        for fqn in fqns:
            entry = full["state"].get(fqn)
            if entry:
                state[index] = {k: v for k, v in entry.items() if k != MASTER_KEY}
            ids.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": out_groups}


def from_torch_state_dict(torch_state: dict[str, Any], names: Sequence[Sequence[str]],
                          params: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """A ``torch.optim`` state dict as the **full** form; ``names[i]``: FQNs of group ``i``'s params
    in order; ``params`` (FQN -> tensor, e.g. ``model.state_dict()``) supplies the master weights
    (at least fp32: a float64 model keeps float64)."""
    if len(names) != len(torch_state["param_groups"]):
        raise ValueError(f"{len(names)} name lists for {len(torch_state['param_groups'])} param groups")
    state, groups = {}, []
    for group, fqns in zip(torch_state["param_groups"], names):
        if len(group["params"]) != len(fqns):
            raise ValueError(f"a group of {len(group['params'])} params was given {len(fqns)} names")
        for pid, fqn in zip(group["params"], fqns):
            entry = dict(torch_state["state"].get(pid, {}))
            if params is not None:
                master = params[fqn].detach()
                entry[MASTER_KEY] = master.to(torch.promote_types(master.dtype, torch.float32))
            state[fqn] = entry
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(fqns)})
    return {"param_groups": groups, "state": state}
