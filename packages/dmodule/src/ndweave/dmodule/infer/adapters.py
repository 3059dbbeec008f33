"""Low-rank adapters found in the dataflow: a branch ``up(down(x)) * scale`` added to a linear's own
output ``base(x)`` (PEFT's LoRA, and any adapter written the same way), with ``down`` of a rank
below both the input and the output features.

Sharding such a branch as a block of its own (``down`` column-wise, ``up`` row-wise) would leave its
base replicated, and the frozen base is what holds the memory. Instead the branch follows its base,
so that it costs no collective of its own:

- a **column-wise** base: ``down`` replicated (every rank computes the whole rank-``r`` value) and
  ``up`` column-wise like the base, their outputs added shard by shard;
- a **row-wise** base: ``down`` row-wise like the base (its output a partial sum, as the base's) and
  ``up`` replicated on that partial sum; the two partial sums are added and reduced once, at the
  module holding the base and the branch (the adapter's wrapper).

In both, the adapter's replicated weight gets a partial-sum gradient, reduced with the other
partial gradients by ``finish_grad_sync()``. Found by the dataflow alone, never by names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ndweave.dmodule.infer.cuts import base_name
from ndweave.dmodule.infer.linears import Linear
from ndweave.dmodule.infer.modules import common_ancestor
from ndweave.dmodule.infer.trace import Trace

__all__ = ["Adapter", "find_adapters"]

# ops a branch's value passes unchanged in layout (a scale by a number, a cast, dropout)
_PASSES = frozenset(("mul", "div", "to", "type_as", "contiguous", "dropout", "float", "double", "half", "bfloat16"))
# ... and views keeping the features last (GPT-2's Conv1D multiplies a (batch * seq, features) view)
_VIEWS = frozenset(("view", "reshape", "_unsafe_view", "flatten"))


@dataclass(frozen=True)
class Adapter:
    """A low-rank branch and the linear whose output it is added to."""

    base: Linear
    down: Linear
    up: Linear
    join: int
    """Index of the op adding the branch to the base's output."""
    module: str
    """The innermost module running the base, the branch and the addition (PEFT's ``lora.Linear``)."""


def find_adapters(trace: Trace, linears: dict[int, Linear]) -> list[Adapter]:
    """Every low-rank branch of ``trace`` added to a linear's output (see the module docstring)."""
    ops = {op.index: op for op in trace.leaves()}
    by_output = {lin.y: lin for lin in linears.values()}
    consumers = trace.consumers()
    shapes = {vid: v.shape for vid, v in trace.values.items()}

    def source(vid: int) -> int:
        """``vid`` traced back through ops that leave it the same value up to a scale or cast."""
        while True:
            op = ops.get(trace.values[vid].producer) if trace.values[vid].producer is not None else None
            tensors = op.inputs if op is not None else ()
            if op is None or not tensors or not _keeps(op, tensors[0], vid, shapes) or \
                    any(shapes[t] and t != tensors[0] for t in tensors):
                return vid
            vid = tensors[0]

    found = []
    for up in linears.values():
        down = by_output.get(up.x)
        if down is None or down is up:
            continue
        rank = shapes[down.y][-1]
        if not rank < min(shapes[down.x][-1], shapes[up.y][-1]):
            continue
        join = _join(up.y, consumers, shapes)
        if join is None:
            continue
        branch = {source(v) for v in join.inputs}
        bases = [by_output[v] for v in branch if v in by_output and by_output[v] not in (up, down)]
        if len(bases) != 1 or source(bases[0].x) != source(down.x) or \
                shapes[bases[0].y][-1:] != shapes[join.outputs[0]][-1:]:
            continue
        base = bases[0]
        module = common_ancestor([base.module, down.module, up.module, join.module])
        found.append(Adapter(base, down, up, join.index, module))
    return found


def _keeps(op, before: int, after: int, shapes: dict) -> bool:
    """Whether ``op`` turns ``before`` into ``after`` as the same values, features last."""
    name = base_name(op.name)
    if name in _VIEWS:
        return shapes[before][-1:] == shapes[after][-1:] and math.prod(shapes[before]) == math.prod(shapes[after])
    return name in _PASSES and shapes[before] == shapes[after]


def _join(vid: int, consumers: dict, shapes: dict):
    """The ``add`` that takes ``vid`` (after scales and casts) with another value of its shape."""
    seen = 0
    while seen < 8:  # (a few scales and casts; a branch is short)
        seen += 1
        users = consumers.get(vid, [])
        if len(users) != 1:
            return None
        op = users[0]
        name = base_name(op.name)
        if name == "add" and len(op.inputs) == 2 and all(shapes[v] == shapes[vid] for v in op.inputs):
            return op
        if len(op.outputs) != 1 or not _keeps(op, vid, op.outputs[0], shapes) or \
                any(shapes[t] and t != vid for t in op.inputs):
            return None
        vid = op.outputs[0]
    return None

