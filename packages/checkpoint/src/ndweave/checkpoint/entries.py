"""What each entry of a user's ``state`` is, and what it saves as.

An entry is one of:

* **modules**: an ``nn.Module`` (a DModule, a DDP wrapper, a plain model) or a list of them (the
  chunks of one model, e.g. pipeline stages on this rank): the union of their ``state_dict()``s,
  keyed by the original model's FQNs;
* **optimizers**: a ``torch.optim.Optimizer`` (ndweave's are ones too) or a list of them. Saved in
  the FQN-keyed format of ``ndweave.mesh.contracts.optimizer_state``: ``{"state": {fqn: {key:
  value}}, "param_groups": [{..., "params": [fqn, ...]}]}``, whatever the optimizer's own format (a
  torch optimizer's integer ids are turned into FQNs through the modules of the same ``state``);
* **stateful**: anything else with ``state_dict()`` and ``load_state_dict()`` (lr schedulers, data
  positions, data loaders), saved as its state dict;
* **value**: anything else (tensors, numbers, nested dicts), saved as is. Plain tensors and values
  count as the same on every rank: one copy is written.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ndweave.mesh.contracts import StatePiece, from_torch_state_dict, tied_primary

from ndweave.checkpoint.pieces import PieceSet, needs_pieces

__all__ = [
    "as_list",
    "canonical_fqn",
    "entry_kind",
    "group_names",
    "is_torch_format",
    "merge_optimizer_states",
    "modules_of",
    "named_params",
    "optimizer_state",
    "param_names",
    "saved_state",
    "sharded_leaf",
    "tied_primaries",
]


def as_list(value: Any) -> list[Any]:
    """An entry's items: the list of a list or tuple, else ``[value]``."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def entry_kind(value: Any) -> str:
    """``"modules"``, ``"optimizers"``, ``"stateful"`` or ``"value"`` (module docstring)."""
    items = as_list(value)
    if items and all(isinstance(v, nn.Module) for v in items):
        return "modules"
    if items and all(_is_optimizer(v) for v in items):
        return "optimizers"
    return "stateful" if _is_stateful(value) else "value"


def modules_of(state: dict[str, Any]) -> list[nn.Module]:
    """Every module of the ``state``'s module entries."""
    return [m for v in state.values() if entry_kind(v) == "modules" for m in as_list(v)]


def canonical_fqn(fqn: str) -> str:
    """``fqn`` without ``torch.compile``'s ``_orig_mod.`` segments: a block compiled with
    ``model.layers[0] = torch.compile(model.layers[0])`` saves and loads under the names of the model
    uncompiled (as torch's ``get_model_state_dict`` names them), so a checkpoint serves either."""
    return fqn if "_orig_mod" not in fqn else ".".join(part for part in fqn.split(".") if part != "_orig_mod")


def module_state(modules: Iterable[nn.Module]) -> dict[str, Any]:
    """The union of the modules' state dicts by canonical FQN (chunks of one model hold disjoint FQNs;
    a tied weight that two chunks both hold is taken from the first)."""
    merged: dict[str, Any] = {}
    for module in modules:
        for key, value in module.state_dict().items():
            merged.setdefault(canonical_fqn(key), value)
    return merged


def named_params(state: dict[str, Any], optimizer: Any) -> dict[str, torch.Tensor]:
    """``FQN -> parameter`` of the state's modules and of the optimizer's own ``models`` (ndweave's
    optimizers keep them)."""
    modules = modules_of(state) + [m for m in getattr(optimizer, "models", []) if isinstance(m, nn.Module)]
    params: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, param in module.named_parameters():
            params.setdefault(canonical_fqn(name), param)
    return params


def param_names(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """``id(param) -> FQN`` of :func:`named_params` (a tied parameter: its first name)."""
    names: dict[int, str] = {}
    for name, param in named_params(state, optimizer).items():
        names.setdefault(id(param), name)
    return names


def group_names(state: dict[str, Any], key: str, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The FQNs of each param group's params, in order; ``ValueError`` naming a param no module holds."""
    names = param_names(state, optimizer)
    out = []
    for index, group in enumerate(optimizer.param_groups):
        fqns = []
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"optimizer {key!r}: a parameter of shape {tuple(param.shape)} in param group {index} belongs to "
                    "no module of the state; put the model in the same state (e.g. {'model': model, "
                    f"'{key}': optimizer}}) so its state is saved under the parameter's FQN")
            fqns.append(names[id(param)])
        out.append(fqns)
    return out


def tied_primaries(state: dict[str, Any], optimizer: Any) -> dict[str, str]:
    """``FQN -> primary FQN`` of the optimizer's parameters that are the second copy of a weight tied
    across pipeline stages (``ndweave.mesh.contracts.tied_primary``). Their optimizer state is
    the primary's: saved once, under the primary's FQN (as one device's optimizer holds it), by the
    rank holding the primary, and loaded from there into every copy."""
    found = {fqn: tied_primary(param) for fqn, param in named_params(state, optimizer).items()}
    return {fqn: primary for fqn, primary in found.items() if primary is not None and primary != fqn}


def is_torch_format(state_dict: dict[str, Any]) -> bool:
    """A ``torch.optim`` state dict (integer parameter ids) rather than the FQN-keyed format."""
    ids = list(state_dict.get("state", {})) + [p for g in state_dict.get("param_groups", []) for p in g["params"]]
    return bool(ids) and all(isinstance(i, int) for i in ids)


def optimizer_state(state: dict[str, Any], key: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """One optimizer's state dict in the FQN-keyed format: its own when it already is (ndweave's
    ``DistributedOptimizer``), a torch optimizer's with parameter ids turned into FQNs; without the
    state of tied copies (:func:`tied_primaries`)."""
    own = optimizer.state_dict()
    sd = from_torch_state_dict(own, group_names(state, key, optimizer)) if is_torch_format(own) else own
    primaries = tied_primaries(state, optimizer)
    if not primaries:
        return sd
    # a tied copy's state is the primary's (equal grads, equal steps): written once, by the primary
    return {"state": {fqn: entry for fqn, entry in sd["state"].items() if fqn not in primaries},
            "param_groups": [{**g, "params": list(dict.fromkeys(primaries.get(f, f) for f in g["params"]))}
                             for g in sd["param_groups"]]}


def merge_optimizer_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Several optimizers' FQN-keyed states as one: disjoint parameters (the chunks of one model),
    group ``i``'s params concatenated, its hyperparameters from the first."""
    if len(states) == 1:
        return states[0]
    merged: dict[str, Any] = {"state": {}, "param_groups": [dict(g) for g in states[0]["param_groups"]]}
    for sd in states:
        merged["state"].update(sd["state"])
    for index, group in enumerate(merged["param_groups"]):
        group["params"] = [fqn for sd in states if index < len(sd["param_groups"]) for fqn in sd["param_groups"][index]["params"]]
    return merged


def sharded_leaf(value: Any, *, with_replicas: bool) -> Any:
    """A state value as DCP gets it: pieces (one or a list) as a :class:`PieceSet`, a DTensor DCP
    cannot describe (``StridedShard``) too; ``None`` for pieces this rank need not write."""
    pieces = [value] if isinstance(value, StatePiece) else value
    if isinstance(pieces, (list, tuple)) and pieces and all(isinstance(p, StatePiece) for p in pieces):
        kept = [p for p in pieces if with_replicas or not p.is_replica]
        return PieceSet(kept) if kept else None
    if needs_pieces(value):
        return PieceSet.of_dtensor(value, with_replicas=with_replicas)
    return value


def _leaves_for_save(tree: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        leaf = _leaves_for_save(value) if isinstance(value, dict) else sharded_leaf(value, with_replicas=False)
        if leaf is not None:
            out[key] = leaf
    return out


def saved_state(state: dict[str, Any]) -> dict[str, Any]:
    """The nested dict DCP saves for ``state``: each entry's state dict, sharded values as
    :class:`PieceSet`s of what this rank writes (views of the live tensors)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of named entries, e.g. {{'model': model, 'optimizer': opt}}; "
                        f"got {type(state).__name__}")
    out: dict[str, Any] = {}
    for key, value in state.items():
        kind = entry_kind(value)
        if kind == "modules":
            out[key] = _leaves_for_save(module_state(as_list(value)))
        elif kind == "optimizers":
            merged = merge_optimizer_states([optimizer_state(state, key, o) for o in as_list(value)])
            out[key] = {"state": _leaves_for_save(merged["state"]), "param_groups": merged["param_groups"]}
        else:
            value = value.state_dict() if kind == "stateful" else value
            leaf = _leaves_for_save(value) if isinstance(value, dict) else sharded_leaf(value, with_replicas=False)
            if leaf is not None:
                out[key] = leaf
    return out
