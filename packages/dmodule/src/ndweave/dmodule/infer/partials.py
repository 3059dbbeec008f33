"""Which outputs of a module are partial sums, when its row-wise linears run inside its own forward.

A block whose linears are multiplied inside one module (experts stored as 3-D weights, looped over
in the module's forward) runs that module as a whole on this rank's shards (``local_block``). Its
row-wise linears then give partial sums, and so does whatever is *linear* in them: scaled by a
replicated value (a routing weight), added to another partial sum, reshaped, scattered into zeros
(``index_add_`` of ``zeros_like``). :func:`partial_outputs` follows that through the module's ops
and says, for each tensor the module returns, whether it is a partial sum (reduced by the plan) or
the same whole value on every rank. Anything else done to a partial sum (an activation, adding a
replicated bias: it would be counted once per rank) means the module cannot run this way.
"""

from __future__ import annotations

from ndweave.dmodule.infer.cuts import base_name
from ndweave.dmodule.infer.patterns import Block
from ndweave.dmodule.infer.trace import ModuleCall, Trace

__all__ = ["follow_partials", "partial_outputs"]

_CARRY = frozenset(("to", "view", "reshape", "_unsafe_view", "contiguous", "transpose", "permute", "getitem",
                    "unsqueeze", "squeeze", "flatten", "unflatten", "clone", "neg", "sum", "cat", "stack", "type_as"))
_SCALE = frozenset(("mul", "div", "true_divide"))  # a partial sum times (or over) a whole value
_ZEROS = frozenset(("zeros", "zeros_like", "new_zeros"))


def partial_outputs(trace: Trace, block: Block, call: ModuleCall) -> tuple[list[bool] | None, str]:
    """For each tensor ``call`` returned, whether it is a partial sum of the block's row-wise
    linears; ``(None, why)`` if some op of the module does something to one that is not linear in it."""
    return follow_partials(trace, {lin.op: lin.y for lin in block.rows}, call)


def follow_partials(trace: Trace, sources: dict[int, int], call: ModuleCall) -> tuple[list[bool] | None, str]:
    """:func:`partial_outputs` from the outputs of the ops ``sources`` (op index -> value id) that
    compute partial sums (row-wise products, a vocab-parallel lookup)."""
    partial = set(sources.values())
    zeros: set[int] = set()
    for op in trace.leaves():
        if not call.first_op <= op.index < call.end_op:
            continue
        base = base_name(op.name)
        if base in _ZEROS:
            zeros.update(op.outputs)
            continue
        hit = [v for v in op.inputs if v in partial]
        if not hit or op.index in sources:
            continue
        others = [v for v in op.inputs if v not in partial]
        if base in _CARRY and (base not in ("cat", "stack") or not others):
            partial.update(op.outputs)
        elif base in _SCALE and len(hit) == 1 and op.inputs[0] in partial:
            partial.update(op.outputs)
        elif base in ("add", "sub") and not others:
            partial.update(op.outputs)
        elif base == "index_add" and op.inputs[0] in zeros | partial and op.inputs[-1] in partial:
            partial.update(op.outputs)  # into zeros (the same on every rank) or a partial sum: a partial sum
        else:
            return None, (f"{op.name} in {op.module or '<root>'} uses a partial sum (of row-wise linears, of a "
                          "vocab-parallel lookup) in a way that is not linear in it")
    return [v in partial for v in call.outputs], "its row-wise outputs are partial sums, reduced at its output"
