"""Where a sharded tensor dim goes through one recorded op (the rules the planner walks with).

A value of a tensor-parallel region is cut along one tensor dim (features after a column-wise
linear, heads after the model splits them): a :class:`Cut`, which also covers a dim merged with
others (``(B, H, T, D) -> (B * H, T, D)``: each rank holds its heads of every batch element).
``follow(op, cuts, shapes)`` answers, for one op of the trace, the cut of each output, or raises
:class:`Unsupported` naming why the op would not give each rank its own piece of the result (a
reduction over the cut dim, a reshape that mixes it with another dim, a replicated tensor of full
size meeting it, ...). Ops split into:

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

__all__ = ["Cut", "ELEMENTWISE", "Pieces", "Unsupported", "base_name", "follow", "reshape_cut"]


class Unsupported(Exception):
    """An op the planner cannot run on per-rank pieces; the message says why."""


@dataclass(frozen=True)
class Cut:
    """Tensor dim ``dim`` is ``outer x size x inner`` (row-major) and ``size`` is what the ranks
    split: each holds a contiguous ``size / tp`` block of it, for every outer and inner index. A
    plain ``Shard(dim)`` has ``outer == 1``."""

    dim: int
    outer: int = 1
    inner: int = 1

    def size(self, shape: tuple[int, ...]) -> int:
        """The extent the ranks split."""
        return shape[self.dim] // (self.outer * self.inner)

    def at(self, dim: int) -> "Cut":
        return Cut(dim, self.outer, self.inner)

    @staticmethod
    def of(dim: int, outer: int, inner: int) -> "Cut":
        """With ``outer == 1`` each rank holds one contiguous block of the dim whatever ``inner`` is
        (heads repeated for grouped-query attention cut like the query heads): drop it."""
        return Cut(dim, outer, inner if outer > 1 else 1)


@dataclass(frozen=True)
class Pieces:
    """An op that cuts the sharded dim into pieces (offsets and sizes along it, one per output)."""

    dim: int
    bounds: tuple[tuple[int, int], ...]
    """``(start, stop)`` of each output along the sharded dim."""


Shapes = dict[int, tuple[int, ...]]
Cuts = dict[int, Cut]

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


def follow(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts | Pieces:
    """The cut of each output of ``op`` (value id -> cut; outputs not listed are not cut), given the
    cut of each of its cut inputs."""
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


def _single_input(op: Op, sharded: Cuts) -> tuple[int, Cut]:
    """(value id, cut) of the op's first argument, which must be the only cut one."""
    first = op.args[0] if op.args else None
    if not isinstance(first, Ref) or first.id not in sharded or len(sharded) != 1:
        raise Unsupported(f"{op.name}: a sharded value is not its first argument")
    return first.id, sharded[first.id]


def _one_output(op: Op, cut: Cut | None) -> Cuts:
    return {} if cut is None else {op.outputs[0]: cut}


def _sizes(value: Any) -> tuple[int, ...]:
    """Sizes given as ``f(2, 3)`` or ``f((2, 3))``."""
    if len(value) == 1 and isinstance(value[0], (tuple, list)):
        return tuple(value[0])
    return tuple(value)


# ---------------------------------------------------------------------------------- elementwise
def _elementwise(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    out_shape = shapes[op.outputs[0]]
    ndim = len(out_shape)
    aligned = {c.at(ndim - len(shapes[v]) + c.dim) for v, c in sharded.items()}
    if len(aligned) != 1:
        raise Unsupported(f"{op.name}: its inputs are cut along different dims")
    cut = aligned.pop()
    inputs = op.inputs[:1] if base_name(op.name) in _FIRST_ONLY else op.inputs
    for vid in dict.fromkeys(inputs):
        if vid in sharded:
            continue
        shape = shapes[vid]
        local = cut.dim - (ndim - len(shape))
        if 0 <= local < len(shape) and shape[local] != 1:
            raise Unsupported(f"{op.name}: a tensor of shape {shape} that is not sharded meets a value sharded "
                              f"along dim {cut.dim} of {out_shape}")
    return {out: cut for out in op.outputs if len(shapes[out]) == ndim}


# ------------------------------------------------------------------------------------- reshapes
def reshape_cut(in_shape: tuple[int, ...], out_shape: tuple[int, ...], cut: Cut) -> Cut:
    """The cut of a reshape's output: the cut extent, found in the group of input dims merged or
    split together, must land in one output dim (an extent spread over several output dims lands on
    the outermost, the cut then falling on its boundaries: ``N -> (H, D)`` cuts ``H``)."""
    if math.prod(in_shape) != math.prod(out_shape):
        raise Unsupported(f"reshape {in_shape} -> {out_shape} changes the number of elements")
    size = cut.size(in_shape)
    for gi, go in _groups(in_shape, out_shape):
        if cut.dim not in gi:
            continue
        outer = math.prod(in_shape[d] for d in gi if d < cut.dim) * cut.outer
        inner = cut.inner * math.prod(in_shape[d] for d in gi if d > cut.dim)
        for o in go:
            before = math.prod(out_shape[d] for d in go if d < o)
            after = math.prod(out_shape[d] for d in go if d > o)
            if out_shape[o] == 1 or outer % before:
                continue
            if inner % after == 0 and (outer // before) * size * (inner // after) == out_shape[o]:
                return Cut.of(o, outer // before, inner // after)
            spread = after // inner if inner and after % inner == 0 else 0
            if before == outer and spread and size % spread == 0 and out_shape[o] == size // spread:
                return Cut(o, 1, 1)  # the extent spreads over o and the dims after it
        break
    raise Unsupported(f"reshape {in_shape} -> {out_shape} mixes the sharded dim {cut.dim} with another dim")


def _groups(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pairs of (input dims, output dims) of a reshape that hold the same elements."""
    groups = []
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
        groups.append(([d for d in gi if d < len(in_shape)], [d for d in go if d < len(out_shape)]))
        i, o = i + 1, o + 1
    return groups


def _reshape(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = _single_input(op, sharded)
    return _one_output(op, reshape_cut(shapes[vid], shapes[op.outputs[0]], cut))


def _transpose(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = _single_input(op, sharded)
    dim = cut.dim
    ndim = len(shapes[vid])
    if base_name(op.name) == "t":
        a, b = 0, ndim - 1
    else:
        a, b = (_norm_dim(_arg(op, i, n), ndim) for i, n in ((1, "dim0"), (2, "dim1")))
    return _one_output(op, cut.at(b if dim == a else a if dim == b else dim))


def _permute(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = _single_input(op, sharded)
    ndim = len(shapes[vid])
    order = [_norm_dim(d, ndim) for d in _sizes(op.args[1:] or (op.kwargs["dims"],))]
    return _one_output(op, cut.at(order.index(cut.dim)))


def _movedim(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = _single_input(op, sharded)
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
    return _one_output(op, cut.at(order.index(cut.dim)))


def _same_dims(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    """expand / ``*_like`` factories and other ops keeping every dim where it is (new leading dims
    allowed); the cut dim must keep its size."""
    vid, cut = _single_input(op, sharded)
    out = shapes[op.outputs[0]]
    offset = len(out) - len(shapes[vid])
    if offset < 0 or shapes[vid][cut.dim] != out[cut.dim + offset]:
        raise Unsupported(f"{op.name} changes the sharded dim")
    return _one_output(op, cut.at(cut.dim + offset))


def _repeat_interleave(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = _single_input(op, sharded)
    along = _arg(op, 2, "dim")
    if along is None or not isinstance(_arg(op, 1, "repeats"), int) or cut.outer != 1:
        raise Unsupported(f"{op.name} without an int count and a dim")
    if _norm_dim(along, len(shapes[vid])) != cut.dim:
        return _one_output(op, cut)
    # each element repeated in place: a rank's contiguous block stays its own
    return _one_output(op, cut)


def _unsqueeze(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = _single_input(op, sharded)
    new = _norm_dim(_arg(op, 1, "dim"), len(shapes[vid]) + 1)
    return _one_output(op, cut.at(cut.dim + 1 if new <= cut.dim else cut.dim))


def _as_complex(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    """view_as_complex drops a last dim of 2, view_as_real adds one: other dims stay."""
    vid, cut = _single_input(op, sharded)
    if cut.dim >= len(shapes[op.outputs[0]]):
        raise Unsupported(f"{op.name} of the sharded dim")
    return _one_output(op, cut)


# ------------------------------------------------------------------------------------- indexing
def _getitem(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts | Pieces:
    first = op.args[0]
    if not isinstance(first, Ref) or first.id not in sharded or len(sharded) != 1:
        raise Unsupported("a sharded tensor used as an index")
    shape, cut = shapes[first.id], sharded[first.id]
    dim = cut.dim
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
            return _one_output(op, cut.at(out_dim))
        in_dim += 1
        out_dim += 0 if isinstance(item, int) else 1
    raise Unsupported("index parsing")


def _split(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts | Pieces:
    vid, cut = _single_input(op, sharded)
    dim = cut.dim
    shape = shapes[vid]
    along = _norm_dim(_arg(op, 2, "dim", 0), len(shape))
    base = base_name(op.name)
    if along != dim:
        return {out: cut for out in op.outputs}
    if base == "unbind":
        raise Unsupported("unbind along the sharded dim")
    sizes = [shapes[out][dim] for out in op.outputs]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return Pieces(dim, tuple((s, s + n) for s, n in zip(starts, sizes)))


def _unbind(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = _single_input(op, sharded)
    along = _norm_dim(_arg(op, 1, "dim", 0), len(shapes[vid]))
    if along == cut.dim:
        raise Unsupported("unbind along the sharded dim")
    return {out: cut.at(cut.dim - (along < cut.dim)) for out in op.outputs}


def _cat(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    tensors = [r.id for r in op.args[0] if isinstance(r, Ref)] if op.args else []
    tensors = [v for v in tensors if math.prod(shapes[v]) > 0]  # torch.cat skips empty (0,) tensors
    ndim = len(shapes[op.outputs[0]])
    stack = base_name(op.name) == "stack"
    along = _norm_dim(_arg(op, 1, "dim", 0), ndim)
    cuts = {sharded.get(v) for v in tensors}
    if len(cuts) != 1 or None in cuts:
        raise Unsupported(f"{op.name} of sharded and unsharded values")
    cut = cuts.pop()
    if stack:
        return _one_output(op, cut.at(cut.dim + 1 if along <= cut.dim else cut.dim))
    if along == cut.dim:
        raise Unsupported(f"{op.name} along the sharded dim")
    return _one_output(op, cut)


# --------------------------------------------------------------------------------- over a dim
def _over_dims(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    """softmax / mean / sum / amax / norms ...: fine over dims other than the sharded one."""
    base = base_name(op.name)
    if base in ("max", "min") and len(op.inputs) == 2:  # torch.max(a, b): per element
        return _elementwise(op, sharded, shapes)
    vid, cut = _single_input(op, sharded)
    dim = cut.dim
    shape = shapes[vid]
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
    return {out: cut.at(out_dim) for out in op.outputs if len(shapes[out]) == len(out_shape)}


# ----------------------------------------------------------------------------------- attention
def _matmul(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    a, b = (r.id if isinstance(r, Ref) else None for r in op.args[:2])
    if a is None or b is None:
        raise Unsupported(f"{op.name} with a non-tensor operand")
    out_ndim = len(shapes[op.outputs[0]])
    cuts = set()
    for vid in (a, b):
        shape = shapes[vid]
        if vid in sharded:
            cut = sharded[vid]
            aligned = cut.dim + out_ndim - len(shape)
            if cut.dim >= len(shape) - 2 or aligned >= out_ndim - 2:
                raise Unsupported(f"{op.name} contracts or keeps the sharded dim as a matrix dim")
            cuts.add(cut.at(aligned))
    if len(cuts) != 1:
        raise Unsupported(f"{op.name} of values sharded along different dims")
    cut = cuts.pop()
    for vid in (a, b):
        shape = shapes[vid]
        local = cut.dim - (out_ndim - len(shape))
        if vid not in sharded and 0 <= local < len(shape) - 2 and shape[local] != 1:
            raise Unsupported(f"{op.name}: an operand that is not sharded has {shape[local]} along the sharded dim")
    return _one_output(op, cut)


def _sdpa(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    qkv = [_arg(op, i, n) for i, n in ((0, "query"), (1, "key"), (2, "value"))]
    for r in qkv:
        if not isinstance(r, Ref) or r.id not in sharded:
            raise Unsupported("attention over query, key and value not all sharded")
        cut, shape = sharded[r.id], shapes[r.id]
        if cut.dim != len(shape) - 3 or cut.outer != 1:
            raise Unsupported("attention with a sharded dim other than the heads")
    mask = _arg(op, 3, "attn_mask")
    if isinstance(mask, Ref):
        shape = shapes[mask.id]
        if mask.id in sharded:
            if sharded[mask.id].dim - len(shape) != -3:
                raise Unsupported("an attention mask sharded along another dim")
        elif len(shape) >= 3 and shape[-3] != 1:
            raise Unsupported("an attention mask with a full heads dim")
    out = shapes[op.outputs[0]]
    return _one_output(op, Cut(len(out) - 3))


_Rule = Callable[[Op, Cuts, Shapes], "Cuts | Pieces"]
_RULES: dict[str, _Rule] = {
    **dict.fromkeys(("view", "reshape", "_unsafe_view", "view_as", "reshape_as", "unflatten", "flatten",
                     "squeeze"), _reshape),
    **dict.fromkeys(("transpose", "swapaxes", "swapdims", "t"), _transpose),
    "permute": _permute,
    "movedim": _movedim,
    **dict.fromkeys(("expand", "expand_as", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                     "randn_like"), _same_dims),
    **dict.fromkeys(("view_as_complex", "view_as_real"), _as_complex),
    "repeat_interleave": _repeat_interleave,
    "unsqueeze": _unsqueeze,
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
