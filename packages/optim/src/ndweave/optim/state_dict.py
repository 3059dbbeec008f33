"""Layout-free optimizer state: FlatShards from any number of ranks, full per-FQN tensors, and the
plain ``torch.optim`` format.

Three forms of the same state, and the functions between them:

* **sharded** (``DistributedOptimizer.state_dict()`` on one rank)::

      {"param_groups": [{"lr": ..., "params": ["layer.weight", ...]}, ...],
       "state": {"layer.weight": {"master_param": FlatShard, "exp_avg": FlatShard, "step": tensor(3.)}}}

  A value may also be a list of FlatShards (several ranks' pieces of one tensor).
* **full**: the same with every FlatShard replaced by the tensor of the parameter's global shape;
  :func:`merge_state_dicts` builds it from every rank's sharded dicts (any DP and TP sizes),
  ``DistributedOptimizer.gather_full_state_dict()`` does so with one collective.
* **torch**: what a single-device ``torch.optim.Adam`` loads (integer param ids, no master):
  :func:`to_torch_state_dict` and :func:`from_torch_state_dict`.

``DistributedOptimizer.load_state_dict`` takes the sharded form (from a rank of any DP size: the
missing ranges are looked up in the shards given, so pass the union of all ranks' shards, e.g.
``merge_state_dicts`` output or one dict per file concatenated) or the full form.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from ndweave.mesh.contracts.sharded_state import FlatShard, merge_flat_shards, slice_flat_shard

__all__ = ["MASTER_KEY", "merge_state_dicts", "union_state_dicts", "to_torch_state_dict", "from_torch_state_dict"]

#: Key of the fp32 master weights in each parameter's state.
MASTER_KEY = "master_param"


def _shards(value: Any) -> list[FlatShard] | None:
    if isinstance(value, FlatShard):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, FlatShard) for v in value):
        return list(value)
    return None


def merge_state_dicts(state_dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The **full** state from the sharded state dicts of every rank (any DP/TP layout).

    Scalars (``step``) are taken from the first rank holding them; tensors are merged with
    :func:`~ndweave.mesh.contracts.merge_flat_shards`, which checks every element is covered.
    """
    pieces: dict[str, dict[str, list[FlatShard]]] = defaultdict(lambda: defaultdict(list))
    scalars: dict[str, dict[str, Any]] = defaultdict(dict)
    for sd in state_dicts:
        for fqn, entry in sd["state"].items():
            for key, value in entry.items():
                shards = _shards(value)
                if shards is not None:
                    pieces[fqn][key].extend(shards)
                else:
                    scalars[fqn].setdefault(key, value)
    state: dict[str, dict[str, Any]] = {}
    for fqn in list(pieces) + [f for f in scalars if f not in pieces]:
        state[fqn] = dict(scalars.get(fqn, {}))
        for key, shards in pieces.get(fqn, {}).items():
            state[fqn][key] = merge_flat_shards(shards)
    return {"param_groups": [dict(g) for g in state_dicts[0]["param_groups"]], "state": state}


def union_state_dicts(state_dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One sharded state dict holding every shard of ``state_dicts`` (lists of FlatShards), without
    materializing full tensors."""
    state: dict[str, dict[str, Any]] = defaultdict(dict)
    for sd in state_dicts:
        for fqn, entry in sd["state"].items():
            for key, value in entry.items():
                shards = _shards(value)
                if shards is None:
                    state[fqn].setdefault(key, value)
                else:
                    state[fqn].setdefault(key, [])
                    state[fqn][key].extend(shards)
    return {"param_groups": [dict(g) for g in state_dicts[0]["param_groups"]], "state": dict(state)}


def resolve_value(value: Any, key: str, fqn: str, start: int, end: int, local_shape: tuple[int, ...],
                  global_shape: tuple[int, ...], local_offset: tuple[int, ...]) -> tuple[Any, bool]:
    """``(value for the range [start, end) of fqn's local tensor, is_elementwise)`` from any form."""
    shards = _shards(value)
    if shards is not None:
        for s in shards:  # the same layout: take it as is
            if (s.start, s.end, tuple(s.local_offset), tuple(s.local_shape)) == (start, end, local_offset, local_shape):
                return s.data.reshape(-1), True
        return slice_flat_shard(merge_flat_shards(shards), start, end, local_shape, local_offset), True
    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(global_shape) and (value.dim() > 0 or key != "step"):
        return slice_flat_shard(value, start, end, local_shape, local_offset), True
    return value, False


def to_torch_state_dict(full: dict[str, Any], names: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """The **full** state as ``torch.optim.Optimizer.load_state_dict`` takes it.

    ``names[i]`` are the FQNs of the target optimizer's group ``i`` params, in its order (default:
    the FQN lists of ``full["param_groups"]``). Master weights are left out: load them into the model
    (``{fqn: entry["master_param"]}``).
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
    in order; ``params`` (FQN -> tensor, e.g. ``model.state_dict()``) supplies the master weights."""
    state, groups = {}, []
    for group, fqns in zip(torch_state["param_groups"], names):
        if len(group["params"]) != len(fqns):
            raise ValueError(f"a group of {len(group['params'])} params was given {len(fqns)} names")
        for pid, fqn in zip(group["params"], fqns):
            entry = dict(torch_state["state"].get(pid, {}))
            if params is not None:
                entry[MASTER_KEY] = params[fqn].detach().float()
            state[fqn] = entry
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(fqns)})
    return {"param_groups": groups, "state": state}
