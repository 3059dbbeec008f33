"""Experts found by structure, for ``get_plan("auto", model, expert_parallel=True)``.

An **experts module** is a module whose own parameters all stack the same number ``E >= 2`` of
experts on dim 0 (at least one of them 3-D: ``(E, out, in)``), called as the expert-parallel
dispatch calls it: ``(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` with an integer
index and ``k <= E`` (transformers' ``MixtralExperts``, ``Qwen2MoeExperts``, ...; any module of
your own of that shape). Names are never read: only the parameters' shapes and the traced call.
The plan divides each one over the ``"EP"`` dim (the ``expert_parallel`` patch).

Experts kept as a ``ModuleList`` of expert modules (each called by the MoE block's own loop) have
no such module: the dispatch cannot take them over, and :func:`expert_lists` finds them so the
planner can say so. A ``ModuleList`` of modules of one type and parameter shapes whose calls do
not feed one another (in a stack of layers each takes what the one before computed) is such a list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ndweave.dmodule.infer.modules import Boundaries
from ndweave.dmodule.infer.trace import Ref

__all__ = ["Experts", "expert_lists", "find_experts"]


@dataclass(frozen=True)
class Experts:
    """One module stacking its experts' weights."""

    fqn: str
    """The module's FQN."""
    num_experts: int
    """``E``: the experts stacked on dim 0 of each of its parameters."""
    params: tuple[str, ...]
    """FQNs of its parameters (each ``(E, ...)``)."""


def find_experts(b: Boundaries, model: nn.Module) -> tuple[list[Experts], list[str]]:
    """The experts modules of ``model`` (traced in ``b``), and a line for each module stacking
    3-D weights that is not one, saying why (it is planned like the dense layers)."""
    found: list[Experts] = []
    refused: list[str] = []
    for fqn, call in b.calls.items():
        params = dict(model.get_submodule(fqn).named_parameters(recurse=False))
        if not any(p.ndim >= 3 for p in params.values()):
            continue
        why = _not_stacked(params) or _not_routed(b, call, next(iter(params.values())).shape[0])
        if why is not None:
            refused.append(f"{fqn}: not expert parallel, planned like the dense layers (stacks 3-D weights but is "
                           f"not an experts module: {why})")
            continue
        names = tuple(f"{fqn}.{n}" if fqn else n for n in params)
        found.append(Experts(fqn, next(iter(params.values())).shape[0], names))
    return found, refused


def _not_stacked(params: dict[str, torch.Tensor]) -> str | None:
    counts = {p.shape[0] if p.ndim >= 2 else None for p in params.values()}
    if len(counts) != 1 or None in counts or counts == {1}:
        return f"its parameters do not all stack one number of experts on dim 0 " \
               f"({[(n, tuple(p.shape)) for n, p in params.items()]})"
    return None


def _not_routed(b: Boundaries, call, num_experts: int) -> str | None:
    """Why the call is not ``(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))``, or ``None``."""
    refs = [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, Ref)]
    values = [b.trace.values[r.id] for r in refs]
    got = [(tuple(v.shape), str(v.dtype).removeprefix("torch.")) for v in values]
    expected = "called as (hidden (T, H), top_k_index (T, k) integers, top_k_weights (T, k))"
    if len(values) != 3:
        return f"{expected}, got {len(values)} tensors {got}"
    hidden, index, weights = values
    shaped = len(hidden.shape) == 2 and len(index.shape) == 2 and index.shape == weights.shape \
        and index.shape[0] == hidden.shape[0]
    typed = hidden.dtype.is_floating_point and weights.dtype.is_floating_point and \
        not index.dtype.is_floating_point and index.dtype != torch.bool
    if not (shaped and typed):
        return f"{expected}, got {got}"
    if index.shape[1] > num_experts:
        return f"top-k {index.shape[1]} is more than its {num_experts} experts"
    return None


def expert_lists(b: Boundaries, model: nn.Module) -> list[str]:
    """FQNs of the ``ModuleList`` s of ``model`` that hold experts as separate modules (see the
    module docstring)."""
    found = []
    for fqn, module in model.named_modules():
        children = list(module.children()) if isinstance(module, nn.ModuleList) else []
        if len(children) < 2 or len({_layout(c) for c in children}) != 1:
            continue
        calls = [b.calls.get(f"{fqn}.{i}" if fqn else str(i)) for i in range(len(children))]
        if any(c is None for c in calls) or next(children[0].parameters(), None) is None:
            continue
        if not any(_feeds(b, before, after) for before, after in zip(calls, calls[1:])):
            found.append(fqn)
    return found


def _layout(module: nn.Module) -> tuple:
    return type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def _feeds(b: Boundaries, before, after) -> bool:
    """Whether a tensor ``after`` takes is computed from ``before``'s output (a residual stack of
    layers is; experts each take their own rows of one input)."""
    reached = set(before.outputs)
    for op in b.trace.leaves():
        if before.end_op <= op.index < after.first_op and reached & set(op.inputs):
            reached.update(op.outputs)
    return any(a.id in reached for a in (*after.args, *after.kwargs.values()) if isinstance(a, Ref))
