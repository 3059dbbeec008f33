"""Where a sharded tensor dim goes through one recorded op (the rules the planner walks with).

A value of a tensor-parallel region is sharded along one tensor dim (features after a column-wise
linear, heads after the model splits them). ``follow(op, sharded, shapes)`` answers, for one op of the
trace, which dim of each output is sharded, or raises :class:`Unsupported` naming why the op would
not give each rank its own piece of the result (a reduction over the sharded dim, a reshape that
mixes it with another dim, a replicated tensor of full size meeting it, ...). Ops split into:

- per element (activations, arithmetic, dropout, casts): every tensor input either sharded along the
  same (broadcast-aligned) dim or of size 1 there;
- shape ops (view / reshape / transpose / permute / (un)squeeze / expand / getitem / cat / chunk ...):
  the dim moves; a reshape keeps the shard only where it is the outermost dim of the group of dims
  it is merged with or split into (heads: ``(.., H*D) -> (.., H, D)``);
- over dims (softmax, mean, norms): fine when the dim they work on is not the sharded one;
- attention (``matmul`` of two activations, ``scaled_dot_product_attention``): the sharded dim must
  be a batch dim (heads) of every operand.

Slices, ``split`` and ``chunk`` along the sharded dim are reported as :class:`Pieces` (a fused q|k|v
or gate|up projection) rather than followed: only the planner knows whether the value is a
projection's own output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ndweave.mesh.trace import Op, Ref

__all__ = ["ELEMENTWISE", "Pieces", "Unsupported", "base_name", "follow", "reshape_dim"]


class Unsupported(Exception):
    """An op the planner cannot run on per-rank pieces; the message says why."""


@dataclass(frozen=True)
class Pieces:
    """An op that cuts the sharded dim into pieces (offsets and sizes along it, one per output)."""

    dim: int
    bounds: tuple[tuple[int, int], ...]
    """``(start, stop)`` of each output along the sharded dim."""


Shapes = dict[int, tuple[int, ...]]

# Ops computing each output element from the elements at the same (broadcast) position.
ELEMENTWISE = frozenset("""
    to type type_as float double half bfloat16 contiguous clone detach alias view_as_real
    neg abs exp expm1 log log1p log2 sqrt rsqrt reciprocal square pow sign sin cos tanh sigmoid erf erfc
    relu relu6 gelu silu mish elu selu celu leaky_relu hardswish hardsigmoid hardtanh softplus softsign
    logsigmoid tanhshrink prelu rrelu threshold clamp clip clamp_min clamp_max nan_to_num
    dropout alpha_dropout feature_alpha_dropout
    add sub rsub mul div true_divide floor_divide remainder fmod maximum minimum where masked_fill lerp addcmul addcdiv
    eq ne lt le gt ge logical_and logical_or logical_not bitwise_and bitwise_or bitwise_not isnan isinf isfinite
""".split())
_FIRST_ONLY = frozenset(("to", "type_as"))  # the other tensor only lends its dtype / device

_DUNDER = {"radd": "add", "iadd": "add", "rmul": "mul", "imul": "mul", "rsub": "rsub", "isub": "sub",
           "truediv": "div", "rtruediv": "div", "itruediv": "div", "floordiv": "floor_divide",
           "matmul": "matmul", "rmatmul": "matmul", "getitem": "getitem", "setitem": "setitem",
           "and": "logical_and", "or": "logical_or", "invert": "bitwise_not", "mod": "remainder"}


def base_name(name: str) -> str:
    """``"Tensor.__radd__"`` -> ``"add"``, ``"Tensor.mul_"`` -> ``"mul"``, ``"F.gelu"`` -> ``"gelu"``."""
    base = name.rsplit(".", 1)[-1]
    if base.startswith("__") and base.endswith("__"):
        base = base[2:-2]
        return _DUNDER.get(base, base)
    if base.endswith("_") and not base.startswith("_"):
        base = base[:-1]
    return base


def follow(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int] | Pieces:
    """Sharded dim of each output of ``op`` (value id -> dim; outputs not listed are not sharded),
    given the sharded dim of its sharded inputs (value id -> dim)."""
    base = base_name(op.name)
    if base in ELEMENTWISE:
        return _elementwise(op, sharded, shapes)
    rule = _RULES.get(base)
    if rule is None:
        raise Unsupported(f"{op.name} has no rule for sharded inputs")
    return rule(op, sharded, shapes)


# ------------------------------------------------------------------------------------- helpers
def _arg(op: Op, index: int, name: str, default: Any = None) -> Any:
    if len(op.args) > index:
        return op.args[index]
    return op.kwargs.get(name, default)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _single_input(op: Op, sharded: dict[int, int]) -> tuple[int, int]:
    """(value id, sharded dim) of the op's first argument, which must be the sharded one."""
    first = op.args[0] if op.args else None
    if not isinstance(first, Ref) or first.id not in sharded or len(sharded) != 1:
        raise Unsupported(f"{op.name}: a sharded value is not its first argument")
    return first.id, sharded[first.id]


def _one_output(op: Op, dim: int | None) -> dict[int, int]:
    return {} if dim is None else {op.outputs[0]: dim}


def _sizes(value: Any) -> tuple[int, ...]:
    """Sizes given as ``f(2, 3)`` or ``f((2, 3))``."""
    if len(value) == 1 and isinstance(value[0], (tuple, list)):
        return tuple(value[0])
    return tuple(value)


# ---------------------------------------------------------------------------------- elementwise
def _elementwise(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    out_shape = shapes[op.outputs[0]]
    ndim = len(out_shape)
    aligned = {ndim - len(shapes[v]) + d for v, d in sharded.items()}
    if len(aligned) != 1:
        raise Unsupported(f"{op.name}: its inputs are sharded along different dims")
    dim = aligned.pop()
    inputs = op.inputs[:1] if base_name(op.name) in _FIRST_ONLY else op.inputs
    for vid in dict.fromkeys(inputs):
        if vid in sharded:
            continue
        shape = shapes[vid]
        local = dim - (ndim - len(shape))
        if 0 <= local < len(shape) and shape[local] != 1:
            raise Unsupported(f"{op.name}: a tensor of shape {shape} that is not sharded meets a value sharded "
                              f"along dim {dim} of {out_shape}")
    return {out: dim for out in op.outputs if len(shapes[out]) == ndim}


# ------------------------------------------------------------------------------------- reshapes
def reshape_dim(in_shape: tuple[int, ...], out_shape: tuple[int, ...], dim: int) -> int:
    """The output dim carrying input ``dim``'s shard through a reshape, where the shard stays one
    contiguous block per rank: ``dim`` must be the outermost (non-1) dim of its group of merged or
    split dims, and lands on the outermost (non-1) dim of the matching output group."""
    if math.prod(in_shape) != math.prod(out_shape):
        raise Unsupported(f"reshape {in_shape} -> {out_shape} changes the number of elements")
    i = o = 0
    while i < len(in_shape) or o < len(out_shape):
        gi, go = [i], [o]
        pi = in_shape[i] if i < len(in_shape) else 1
        po = out_shape[o] if o < len(out_shape) else 1
        while pi != po:
            if pi < po:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                o += 1
                go.append(o)
                po *= out_shape[o]
        if dim in gi:
            leading = [d for d in gi if in_shape[d] != 1]
            if leading[:1] != [dim]:
                raise Unsupported(f"reshape {in_shape} -> {out_shape} mixes sharded dim {dim} with a dim outside it")
            return next(d for d in go if d < len(out_shape) and out_shape[d] != 1)
        i, o = i + 1, o + 1
    raise Unsupported(f"reshape {in_shape} -> {out_shape}: dim {dim} not found")


def _reshape(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    vid, dim = _single_input(op, sharded)
    return _one_output(op, reshape_dim(shapes[vid], shapes[op.outputs[0]], dim))


def _transpose(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    vid, dim = _single_input(op, sharded)
    ndim = len(shapes[vid])
    if base_name(op.name) == "t":
        a, b = 0, ndim - 1
    else:
        a, b = (_norm_dim(_arg(op, i, n), ndim) for i, n in ((1, "dim0"), (2, "dim1")))
    return _one_output(op, b if dim == a else a if dim == b else dim)


def _permute(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    vid, dim = _single_input(op, sharded)
    ndim = len(shapes[vid])
    order = [_norm_dim(d, ndim) for d in _sizes(op.args[1:] or (op.kwargs["dims"],))]
    return _one_output(op, order.index(dim))


def _movedim(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    vid, dim = _single_input(op, sharded)
    ndim = len(shapes[vid])
    src, dst = _arg(op, 1, "source"), _arg(op, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src, dst = [_norm_dim(d, ndim) for d in src], [_norm_dim(d, ndim) for d in dst]
    order = [None] * ndim
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(d for d in range(ndim) if d not in src)
    order = [next(rest) if o is None else o for o in order]
    return _one_output(op, order.index(dim))


def _same_dims(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    """expand / repeat_interleave / contiguous-like ops that keep every dim where it is; the sharded
    dim must keep its size or grow by whole repeats of each element (``repeat_interleave``)."""
    vid, dim = _single_input(op, sharded)
    out = shapes[op.outputs[0]]
    offset = len(out) - len(shapes[vid])
    if base_name(op.name) == "expand" and shapes[vid][dim] != out[dim + offset]:
        raise Unsupported(f"{op.name} grows the sharded dim")
    return _one_output(op, dim + offset)


def _repeat_interleave(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    vid, dim = _single_input(op, sharded)
    along = _arg(op, 2, "dim")
    if along is None or not isinstance(_arg(op, 1, "repeats"), int):
        raise Unsupported(f"{op.name} without an int count and a dim")
    return _one_output(op, dim)  # each element repeated in place: a rank's block stays its own


def _unsqueeze(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    vid, dim = _single_input(op, sharded)
    new = _norm_dim(_arg(op, 1, "dim"), len(shapes[vid]) + 1)
    return _one_output(op, dim + 1 if new <= dim else dim)


def _squeeze(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    vid, dim = _single_input(op, sharded)
    return _one_output(op, reshape_dim(shapes[vid], shapes[op.outputs[0]], dim))


def _flatten(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    return _reshape(op, sharded, shapes)


# ------------------------------------------------------------------------------------- indexing
def _getitem(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int] | Pieces:
    first = op.args[0]
    if not isinstance(first, Ref) or first.id not in sharded or len(sharded) != 1:
        raise Unsupported("a sharded tensor used as an index")
    shape, dim = shapes[first.id], sharded[first.id]
    index = op.args[1] if isinstance(op.args[1], tuple) else (op.args[1],)
    if any(isinstance(i, (Ref, list)) for i in index):
        raise Unsupported("advanced (tensor) indexing of a sharded value")
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    items: list[Any] = []
    for i in index:
        items.extend([slice(None)] * (len(shape) - consumed) if i is Ellipsis else [i])
    items.extend([slice(None)] * (len(shape) + items.count(None) - len(items)))
    in_dim = out_dim = 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        if in_dim == dim:
            if isinstance(item, int):
                raise Unsupported("an integer index into the sharded dim")
            start, stop, step = item.indices(shape[dim])
            if step != 1:
                raise Unsupported("a strided slice of the sharded dim")
            if (start, stop) != (0, shape[dim]):
                return Pieces(out_dim, ((start, stop),))
            return _one_output(op, out_dim)
        in_dim += 1
        out_dim += 0 if isinstance(item, int) else 1
    raise Unsupported("index parsing")


def _split(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int] | Pieces:
    vid, dim = _single_input(op, sharded)
    shape = shapes[vid]
    along = _norm_dim(_arg(op, 2, "dim", 0), len(shape))
    base = base_name(op.name)
    if along != dim:
        return {out: dim for out in op.outputs}
    if base == "unbind":
        raise Unsupported("unbind along the sharded dim")
    sizes = [shapes[out][dim] for out in op.outputs]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return Pieces(dim, tuple((s, s + n) for s, n in zip(starts, sizes)))


def _unbind(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    vid, dim = _single_input(op, sharded)
    along = _norm_dim(_arg(op, 1, "dim", 0), len(shapes[vid]))
    if along == dim:
        raise Unsupported("unbind along the sharded dim")
    return {out: dim - (along < dim) for out in op.outputs}


def _cat(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    tensors = [r.id for r in op.args[0] if isinstance(r, Ref)] if op.args else []
    tensors = [v for v in tensors if math.prod(shapes[v]) > 0]  # torch.cat skips empty (0,) tensors
    ndim = len(shapes[op.outputs[0]])
    stack = base_name(op.name) == "stack"
    along = _norm_dim(_arg(op, 1, "dim", 0), ndim)
    dims = {sharded.get(v) for v in tensors}
    if len(dims) != 1 or None in dims:
        raise Unsupported(f"{op.name} of sharded and unsharded values")
    dim = dims.pop()
    if stack:
        return _one_output(op, dim + 1 if along <= dim else dim)
    if along == dim:
        raise Unsupported(f"{op.name} along the sharded dim")
    return _one_output(op, dim)


# --------------------------------------------------------------------------------- over a dim
def _over_dims(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    """softmax / mean / sum / amax / norms ...: fine over dims other than the sharded one."""
    vid, dim = _single_input(op, sharded)
    shape = shapes[vid]
    base = base_name(op.name)
    if base in ("layer_norm", "rms_norm"):
        normalized = _arg(op, 1, "normalized_shape")
        dims = list(range(len(shape) - len(normalized), len(shape)))
    elif base == "group_norm":
        raise Unsupported("group_norm of a sharded value")
    else:
        given = _arg(op, 1, "dim")
        if given is None:
            raise Unsupported(f"{op.name} over every dim")
        dims = [_norm_dim(d, len(shape)) for d in ([given] if isinstance(given, int) else given)]
    if dim in dims:
        raise Unsupported(f"{op.name} over the sharded dim")
    out_shape = shapes[op.outputs[0]]
    kept = len(out_shape) == len(shape)
    out_dim = dim if kept else dim - sum(1 for d in dims if d < dim)
    return {out: out_dim for out in op.outputs if len(shapes[out]) == len(out_shape)}


# ----------------------------------------------------------------------------------- attention
def _matmul(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    a, b = (r.id if isinstance(r, Ref) else None for r in op.args[:2])
    if a is None or b is None:
        raise Unsupported(f"{op.name} with a non-tensor operand")
    out_ndim = len(shapes[op.outputs[0]])
    batch = out_ndim - 2
    dims = set()
    for vid in (a, b):
        shape = shapes[vid]
        if vid in sharded:
            aligned = sharded[vid] + out_ndim - len(shape)
            if sharded[vid] >= len(shape) - 2 or aligned >= batch:
                raise Unsupported(f"{op.name} contracts or keeps the sharded dim as a matrix dim")
            dims.add(aligned)
    if len(dims) != 1:
        raise Unsupported(f"{op.name} of values sharded along different dims")
    dim = dims.pop()
    for vid in (a, b):
        shape = shapes[vid]
        local = dim - (out_ndim - len(shape))
        if vid not in sharded and 0 <= local < len(shape) - 2 and shape[local] != 1:
            raise Unsupported(f"{op.name}: an operand that is not sharded has {shape[local]} along the sharded dim")
    return _one_output(op, dim)


def _sdpa(op: Op, sharded: dict[int, int], shapes: Shapes) -> dict[int, int]:
    qkv = [_arg(op, i, n) for i, n in ((0, "query"), (1, "key"), (2, "value"))]
    dims = set()
    for r in qkv:
        if not isinstance(r, Ref) or r.id not in sharded:
            raise Unsupported("attention over query, key and value not all sharded")
        shape = shapes[r.id]
        if sharded[r.id] != len(shape) - 3:
            raise Unsupported("attention with a sharded dim other than the heads")
        dims.add(sharded[r.id] - len(shape))
    mask = _arg(op, 3, "attn_mask")
    if isinstance(mask, Ref):
        shape = shapes[mask.id]
        if mask.id in sharded:
            if sharded[mask.id] - len(shape) not in dims:
                raise Unsupported("an attention mask sharded along another dim")
        elif len(shape) >= 3 and shape[-3] != 1:
            raise Unsupported("an attention mask with a full heads dim")
    out = shapes[op.outputs[0]]
    return _one_output(op, len(out) - 3)


_Rule = Callable[[Op, dict[int, int], Shapes], "dict[int, int] | Pieces"]
_RULES: dict[str, _Rule] = {
    **dict.fromkeys(("view", "reshape", "_unsafe_view", "view_as", "reshape_as", "unflatten"), _reshape),
    "flatten": _flatten,
    **dict.fromkeys(("transpose", "swapaxes", "swapdims", "t"), _transpose),
    "permute": _permute,
    "movedim": _movedim,
    **dict.fromkeys(("expand", "expand_as"), _same_dims),
    "repeat_interleave": _repeat_interleave,
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    "getitem": _getitem,
    **dict.fromkeys(("split", "chunk", "split_with_sizes", "tensor_split"), _split),
    "unbind": _unbind,
    **dict.fromkeys(("cat", "concat", "concatenate", "stack"), _cat),
    **dict.fromkeys(("softmax", "log_softmax", "mean", "sum", "amax", "amin", "max", "min", "logsumexp",
                     "norm", "var", "std", "cumsum", "layer_norm", "rms_norm", "group_norm", "argmax",
                     "argmin", "prod", "all", "any"), _over_dims),
    **dict.fromkeys(("matmul", "bmm"), _matmul),
    "scaled_dot_product_attention": _sdpa,
}
