"""The recorded ops that multiply an activation by a weight, and the embedding lookups.

A *linear* is any op computing ``x @ W (+ b)`` with ``W`` a parameter, however the model wrote it:
``F.linear(x, W, b)`` (``nn.Linear``), ``torch.addmm(b, x, W)`` (GPT-2's ``Conv1D``, weight stored
(in, out)), ``x @ W`` / ``torch.matmul``, or any of these on ``W[e]`` (one expert's slice of a 3-D
expert weight) or ``W.t()``. What matters for sharding is which dim of the *parameter* holds the
output features (column-wise cuts it) and which the input features (row-wise cuts it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ndweave.dmodule.infer.cuts import base_name
from ndweave.dmodule.infer.trace import Op, Ref, Trace

__all__ = ["Embedding", "Linear", "find_embeddings", "find_linears"]


@dataclass(frozen=True)
class Linear:
    """One recorded ``x @ W (+ b)``."""

    op: int
    """Index of the op in the trace."""
    module: str
    """FQN of the module running it."""
    x: int
    """Value id of the activation input."""
    y: int
    """Value id of the output."""
    weight: str
    """FQN of the weight parameter."""
    out_dim: int
    """Dim of the weight parameter holding the output features."""
    in_dim: int
    """Dim of the weight parameter holding the input features."""
    bias: str | None
    """FQN of the bias parameter added in the same op, if any."""


@dataclass(frozen=True)
class Embedding:
    """One recorded ``F.embedding(ids, W)``."""

    op: int
    module: str
    ids: int
    y: int
    weight: str


def _param_dims(trace: Trace) -> dict[int, tuple[str, tuple[int, ...]]]:
    """Value id -> (parameter FQN, the parameter dim behind each of its dims) for every parameter
    and every value taken from one by transposes and leading-dim indexing (an expert's weight)."""
    out: dict[int, tuple[str, tuple[int, ...]]] = {}
    for fqn, vid in trace.params.items():
        out.setdefault(vid, (fqn, tuple(range(len(trace.values[vid].shape)))))
    for op in trace.leaves():
        first = op.args[0] if op.args else None
        if not isinstance(first, Ref) or first.id not in out or len(op.outputs) != 1:
            continue
        fqn, dims = out[first.id]
        base = base_name(op.name)
        if base in ("t", "T", "mT", "transpose", "swapaxes") and len(dims) >= 2:
            a, b = op.args[1:3] if base in ("transpose", "swapaxes") else (-2, -1)
            swapped = list(dims)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            out[op.outputs[0]] = (fqn, tuple(swapped))
        elif base in ("to", "contiguous", "type_as", "float", "double", "half", "bfloat16"):
            out[op.outputs[0]] = (fqn, dims)
        elif base == "getitem" and len(trace.values[op.outputs[0]].shape) == len(dims) - 1:
            index = op.args[1] if isinstance(op.args[1], tuple) else (op.args[1],)
            if len(index) == 1 and (isinstance(index[0], (int, Ref))):  # W[e]: one expert
                out[op.outputs[0]] = (fqn, dims[1:])
    return out


def find_linears(trace: Trace) -> dict[int, Linear]:
    """Op index -> :class:`Linear` for every linear op of the trace's leaves."""
    weights = _param_dims(trace)
    found: dict[int, Linear] = {}
    for op in trace.leaves():
        base = base_name(op.name)
        refs = [a.id if isinstance(a, Ref) else None for a in op.args]
        if base == "linear" and len(refs) >= 2:
            x, w = refs[0], refs[1]
            b = refs[2] if len(refs) > 2 else (op.kwargs["bias"].id if isinstance(op.kwargs.get("bias"), Ref) else None)
            out_at, in_at = -2, -1  # F.linear: W is (out, in)
        elif base == "addmm" and len(refs) >= 3:
            b, x, w = refs[0], refs[1], refs[2]
            out_at, in_at = -1, -2
        elif base in ("matmul", "mm") and len(refs) >= 2:
            x, w, b = refs[0], refs[1], None
            out_at, in_at = -1, -2
        else:
            continue
        if w not in weights or x is None or x in weights or len(weights[w][1]) != 2:
            continue
        fqn, dims = weights[w]
        bias = weights[b][0] if b in weights else None
        found[op.index] = Linear(op.index, op.module, x, op.outputs[0], fqn, dims[out_at], dims[in_at], bias)
    return found


def find_embeddings(trace: Trace) -> dict[int, Embedding]:
    """Op index -> :class:`Embedding` for every ``F.embedding`` of a parameter."""
    found: dict[int, Embedding] = {}
    for op in trace.leaves():
        if op.name != "F.embedding" or len(op.args) < 2:
            continue
        ids, weight = op.args[0], op.args[1]
        if isinstance(ids, Ref) and isinstance(weight, Ref) and trace.values[weight.id].param is not None:
            found[op.index] = Embedding(op.index, op.module, ids.id, op.outputs[0], trace.values[weight.id].param)
    return found
