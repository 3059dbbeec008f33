"""Load side: where each value of a checkpoint lands in the user's ``state``, and handing it over.

For every entry of ``state`` (see :mod:`ndweave.checkpoint.entries`) this builds a *destination*:
a nested dict shaped like what was saved, whose tensors are the ones to read into (the live
model tensors, fresh buffers for optimizer state) and whose other leaves are placeholders DCP
replaces. Optimizer destinations are built from the checkpoint's keys, so a state that was never
stepped (no ``exp_avg`` yet) still receives one, in this rank's layout: a
``DistributedOptimizer`` piece of any range, a torch optimizer's DTensor or plain tensor. Once DCP
has read everything, :meth:`Destination.hand_over` gives each entry its values through its own
``load_state_dict`` (modules first: a sharded optimizer then writes its master weights over them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ndweave.mesh.contracts import MASTER_KEY, SCALAR_KEYS, StatePiece, to_torch_state_dict
from ndweave.mesh.torch_compat import local_tensor

from ndweave.checkpoint.entries import (
    as_list,
    canonical_fqn,
    entry_kind,
    group_names,
    is_torch_format,
    named_params,
    sharded_leaf,
    tied_primaries,
)
from ndweave.checkpoint.pieces import PieceSet

__all__ = ["Destination", "destination"]


@dataclass
class Destination:
    """What to read (``tree``), what each entry's FQNs are, and how to hand the values over."""

    tree: dict[str, Any] = field(default_factory=dict)
    """Nested like the saved state: tensors and :class:`PieceSet`s to read into, placeholders."""
    fqns: dict[str, set[str]] = field(default_factory=dict)
    """Per model or optimizer entry, the FQNs this rank loads."""
    saved_fqns: dict[str, set[str]] = field(default_factory=dict)
    """Per model or optimizer entry, the FQNs the checkpoint holds."""
    prefixes: dict[str, str] = field(default_factory=dict)
    """Per model or optimizer entry, what precedes an FQN in a flat key (``"model."``)."""
    problems: list[tuple[str, str]] = field(default_factory=list)
    """``(kind, line)`` found while building: kind ``"missing"`` or ``"mismatched"``."""
    skipped: set[tuple[str, str]] = field(default_factory=set)
    """``(entry, fqn)`` of optimizer state left as it is (a partial load dropped part of it)."""
    _hand_over: list[tuple[int, Callable[[], None]]] = field(default_factory=list)

    def hand_over(self) -> None:
        """Give every entry its values (modules first)."""
        for _, fn in sorted(self._hand_over, key=lambda item: item[0]):
            fn()


def _optimizer_keys(metadata: Metadata, key: str) -> tuple[dict[str, dict[str, Any]], dict[int, list[str]]]:
    """The checkpoint's ``{fqn: {state key: storage metadata}}`` and ``{group: [names]}`` of entry ``key``
    (state keys hold no dots, FQNs may)."""
    state, groups = {}, {}
    for flat, md in metadata.state_dict_metadata.items():
        if flat.startswith(f"{key}.state."):
            fqn, name = flat[len(key) + 7 :].rsplit(".", 1)
            state.setdefault(fqn, {})[name] = md
        elif flat.startswith(f"{key}.param_groups."):
            index, name = flat[len(key) + 14 :].split(".", 1)
            groups.setdefault(int(index), []).append(name)
    return state, groups


def _scalar_target(md: Any) -> Any:
    return torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None


def _modules(dest: Destination, state: dict[str, Any], key: str, metadata: Metadata) -> None:
    modules = as_list(state[key])
    own = [m.state_dict() for m in modules]
    merged: dict[str, Any] = {}
    for sd in own:
        for fqn, value in sd.items():
            merged.setdefault(canonical_fqn(fqn), value)
    dest.tree[key] = {fqn: sharded_leaf(v, with_replicas=True) if isinstance(v, torch.Tensor) else v
                      for fqn, v in merged.items()}
    dest.fqns[key] = set(merged)
    dest.saved_fqns[key] = {k[len(key) + 1 :] for k in metadata.state_dict_metadata if k.startswith(f"{key}.")}
    dest.prefixes[key] = f"{key}."

    def hand_over() -> None:
        with torch.no_grad():
            for module, sd in zip(modules, own):
                for fqn, value in sd.items():
                    name = canonical_fqn(fqn)
                    if not isinstance(value, torch.Tensor):  # a value DCP replaced (a module's extra state)
                        sd[fqn] = dest.tree[key][name]
                    elif merged[name] is not value:  # a tied weight two chunks hold: read once, copied
                        value.copy_(merged[name])
                module.load_state_dict(sd)

    dest._hand_over.append((0, hand_over))


def _optimizers(dest: Destination, state: dict[str, Any], key: str, metadata: Metadata) -> None:
    saved, groups = _optimizer_keys(metadata, key)
    dest.saved_fqns[key] = set(saved)
    dest.prefixes[key] = f"{key}.state."
    dest.tree[key] = {"state": {}, "param_groups": [dict.fromkeys(groups[i]) for i in sorted(groups)]}
    dest.fqns[key] = set()
    handlers = []
    for optimizer in as_list(state[key]):
        own = optimizer.state_dict()
        names = None if not is_torch_format(own) else group_names(state, key, optimizer)
        stored = tied_primaries(state, optimizer)  # a tied copy reads its primary's state
        fqns = [f for g in own["param_groups"] for f in g["params"]] if names is None else [f for g in names for f in g]
        fqns = [stored.get(f, f) for f in fqns]
        dest.fqns[key].update(fqns)
        if not groups:
            dest.problems.append(("missing", f"{key} (the optimizer's state and param groups)"))
            continue
        if len(groups) != len(own["param_groups"]):  # a partial load leaves this optimizer as it is
            dest.problems.append(("mismatched", f"{key}.param_groups: {len(groups)} in the checkpoint, "
                                                f"{len(own['param_groups'])} in the optimizer"))
            continue
        if saved and not any(f in saved for f in fqns):
            dest.problems.append(("missing", f"{key}.state: none of the optimizer's parameters"))
        targets = (_piece_targets(own, saved, stored, key, dest) if names is None
                   else _tensor_targets(optimizer, names, saved, stored, key, dest))
        handlers.append((optimizer, names, stored, targets))
    claimed: dict[str, str] = {}
    for _, _, stored, targets in handlers:
        for fqn, entry in targets.items():
            where = stored.get(fqn, fqn)
            if claimed.setdefault(where, fqn) != fqn:  # DCP reads a key into one destination per rank
                raise NotImplementedError(
                    f"optimizer {key!r}: this rank holds two copies of the tied weight {where!r} "
                    f"({claimed[where]!r} and {fqn!r}) as separate tensors; tie them into one tensor on this rank")
            dest.tree[key]["state"].setdefault(where, {}).update({name: leaf for name, (leaf, _) in entry.items()})

    def hand_over() -> None:
        groups_now = dest.tree[key]["param_groups"]
        for optimizer, names, stored, targets in handlers:
            full_state = {}
            for fqn, entry in targets.items():
                where = stored.get(fqn, fqn)
                if (key, where) in dest.skipped:
                    continue
                read = dest.tree[key]["state"][where]  # values DCP replaced (not tensors) are only here
                full_state[fqn] = {n: filled if isinstance(read[n], PieceSet) else read[n] for n, (_, filled) in entry.items()}
            if names is None:
                _masters_from_model(full_state, optimizer, named_params(state, optimizer))
                optimizer.load_state_dict({"param_groups": groups_now, "state": full_state})
            else:
                optimizer.load_state_dict(to_torch_state_dict({"param_groups": groups_now, "state": full_state}, names))

    dest._hand_over.append((1, hand_over))


def _target(dest: Destination, where: str, name: str, md: Any, shape: torch.Size,
            like: Callable[[torch.dtype], tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """``(leaf to read into, value to hand over)`` for one saved state entry of a parameter of
    global ``shape``: ``like(dtype)`` for an elementwise one (a tensor of the parameter's rank), a
    scalar or placeholder otherwise; ``None`` (and a problem) when its global shape differs."""
    if isinstance(md, TensorStorageMetadata) and name not in SCALAR_KEYS and len(md.size) == len(shape) > 0:
        if md.size == shape:
            return like(md.properties.dtype)
        dest.problems.append(("mismatched", f"{where}.{name}: {tuple(md.size)} in the checkpoint, {tuple(shape)} here"))
        return None
    target = _scalar_target(md)
    return target, target


def _add_targets(dest: Destination, key: str, fqn: str, where: str, saved: dict[str, Any], shape: torch.Size,
                 like: Callable[[torch.dtype], tuple[Any, Any]], targets: dict[str, dict[str, tuple[Any, Any]]]) -> None:
    """Targets of parameter ``fqn`` for the state ``saved`` under the FQN ``where`` (a tied copy's
    primary, else ``fqn``)."""
    for name, md in saved.items():
        found = _target(dest, f"{key}.state.{where}", name, md, shape, like)
        if found is None:
            dest.skipped.add((key, where))
        else:
            targets.setdefault(fqn, {})[name] = found


def _piece_targets(own: dict[str, Any], saved: dict[str, dict[str, Any]], stored: dict[str, str], key: str,
                   dest: Destination) -> dict[str, dict[str, tuple[Any, Any]]]:
    """A sharded optimizer (``StatePiece`` format): for each parameter range it holds and each
    state key saved for it, a fresh piece of that range (or a scalar)."""
    targets: dict[str, dict[str, tuple[Any, Any]]] = {}
    for fqn, entry in own["state"].items():
        master = entry[MASTER_KEY]
        ranges = [master] if isinstance(master, StatePiece) else list(master)

        def fresh(dtype: torch.dtype, ranges=ranges, fqn=fqn) -> tuple[Any, Any]:
            pieces = [StatePiece(fqn, torch.empty(p.end - p.start, dtype=dtype, device=p.data.device), p.layout,
                                 p.start, p.end) for p in ranges]
            return PieceSet(pieces), pieces

        where = stored.get(fqn, fqn)
        _add_targets(dest, key, fqn, where, saved.get(where, {}), torch.Size(ranges[0].layout.global_shape), fresh,
                     targets)
    return targets


def _tensor_targets(optimizer: torch.optim.Optimizer, names: list[list[str]], saved: dict[str, dict[str, Any]],
                    stored: dict[str, str], key: str, dest: Destination) -> dict[str, dict[str, tuple[Any, Any]]]:
    """A torch optimizer: for each parameter and state key saved for it, a tensor like the parameter
    (a DTensor with its placements where it is one), or a scalar. Master weights are skipped: the
    model's own parameters were loaded."""
    targets: dict[str, dict[str, tuple[Any, Any]]] = {}
    for group, fqns in zip(optimizer.param_groups, names):
        for param, fqn in zip(group["params"], fqns):

            def like(dtype: torch.dtype, param=param) -> tuple[Any, Any]:
                tensor = torch.empty_like(param, dtype=dtype).detach()
                return sharded_leaf(tensor, with_replicas=True), tensor

            where = stored.get(fqn, fqn)
            entries = {n: md for n, md in saved.get(where, {}).items() if n != MASTER_KEY}
            _add_targets(dest, key, fqn, where, entries, param.shape, like, targets)
    return targets


def _masters_from_model(full_state: dict[str, Any], optimizer: Any, params: dict[str, torch.Tensor]) -> None:
    """A checkpoint from a torch optimizer has no master weights: take each held range from the
    (already loaded) model parameter, at the optimizer's master precision."""
    own = optimizer.state_dict()["state"]
    for fqn, entry in full_state.items():
        if MASTER_KEY in entry or fqn not in own or fqn not in params:
            continue
        master = own[fqn][MASTER_KEY]
        ranges = [master] if isinstance(master, StatePiece) else list(master)
        flat = local_tensor(params[fqn]).detach().reshape(-1)
        entry[MASTER_KEY] = [StatePiece(fqn, flat[p.start : p.end].to(p.data.dtype), p.layout, p.start, p.end)
                             for p in ranges]


def _stateful(dest: Destination, state: dict[str, Any], key: str) -> None:
    value = state[key]
    own = value.state_dict()
    dest.tree[key] = _tensor_leaves(own)
    dest._hand_over.append((2, lambda: value.load_state_dict(_unpiece(dest.tree[key], own))))


def _value(dest: Destination, state: dict[str, Any], key: str) -> None:
    value = state[key]
    dest.tree[key] = _tensor_leaves(value)

    def hand_over() -> None:
        state[key] = _unpiece(dest.tree[key], value)

    dest._hand_over.append((2, hand_over))


def _tensor_leaves(tree: Any) -> Any:
    """A copy of the containers of ``tree``, with ``StatePiece``s and DTensors DCP cannot describe
    as piece sets (views: DCP reads into them in place)."""
    if isinstance(tree, dict):
        return {k: _tensor_leaves(v) for k, v in tree.items()}
    leaf = sharded_leaf(tree, with_replicas=True)
    if leaf is not tree:
        return leaf
    return [_tensor_leaves(v) for v in tree] if isinstance(tree, list) else tree


def _unpiece(filled: Any, original: Any) -> Any:
    """The filled tree, with piece sets replaced by the tensors they were read into."""
    if isinstance(filled, PieceSet):
        return original
    if isinstance(filled, dict):
        return {k: _unpiece(v, original[k] if isinstance(original, dict) else None) for k, v in filled.items()}
    if isinstance(filled, list):
        return [_unpiece(v, original[i] if isinstance(original, list) and i < len(original) else None)
                for i, v in enumerate(filled)]
    return filled


def destination(state: dict[str, Any], metadata: Metadata) -> Destination:
    """Where every entry of ``state`` reads the checkpoint described by ``metadata``."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of named entries, e.g. {{'model': model}}; got {type(state).__name__}")
    dest = Destination()
    build = {"modules": lambda k: _modules(dest, state, k, metadata),
             "optimizers": lambda k: _optimizers(dest, state, k, metadata),
             "stateful": lambda k: _stateful(dest, state, k),
             "value": lambda k: _value(dest, state, k)}
    for key, value in state.items():
        build[entry_kind(value)](key)
    return dest
