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

from typing import Callable

from ndweave.dmodule.infer.cuts import (Cut, Cuts, Pieces, Shapes, Unsupported, arg, base_name, norm_dim, one_output,
                                        single_input)
from ndweave.dmodule.infer.reshapes import SHAPE_RULES
from ndweave.dmodule.infer.trace import Op, Ref

__all__ = ["ELEMENTWISE", "follow"]

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


# --------------------------------------------------------------------------------- over a dim
def _over_dims(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    """softmax / mean / sum / amax / norms ...: fine over dims other than the sharded one."""
    base = base_name(op.name)
    if base in ("max", "min") and len(op.inputs) == 2:  # torch.max(a, b): per element
        return _elementwise(op, sharded, shapes)
    vid, cut = single_input(op, sharded)
    dim = cut.dim
    shape = shapes[vid]
    if base in ("layer_norm", "rms_norm"):
        normalized = arg(op, 1, "normalized_shape")
        dims = list(range(len(shape) - len(normalized), len(shape)))
    elif base == "group_norm":
        raise Unsupported("group_norm of a sharded value")
    else:
        given = arg(op, 1, "dim")
        if given is None:
            raise Unsupported(f"{op.name} over every dim")
        dims = [norm_dim(d, len(shape)) for d in ([given] if isinstance(given, int) else given)]
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
    return one_output(op, cut)


def _sdpa(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    qkv = [arg(op, i, n) for i, n in ((0, "query"), (1, "key"), (2, "value"))]
    for r in qkv:
        if not isinstance(r, Ref) or r.id not in sharded:
            raise Unsupported("attention over query, key and value not all sharded")
        cut, shape = sharded[r.id], shapes[r.id]
        if cut.dim != len(shape) - 3 or cut.outer != 1:
            raise Unsupported("attention with a sharded dim other than the heads")
    mask = arg(op, 3, "attn_mask")
    if isinstance(mask, Ref):
        shape = shapes[mask.id]
        if mask.id in sharded:
            if sharded[mask.id].dim - len(shape) != -3:
                raise Unsupported("an attention mask sharded along another dim")
        elif len(shape) >= 3 and shape[-3] != 1:
            raise Unsupported("an attention mask with a full heads dim")
    out = shapes[op.outputs[0]]
    return one_output(op, Cut(len(out) - 3))


_Rule = Callable[[Op, Cuts, Shapes], "Cuts | Pieces"]
_RULES: dict[str, _Rule] = {
    **SHAPE_RULES,
    **dict.fromkeys(("softmax", "log_softmax", "mean", "sum", "amax", "amin", "max", "min", "logsumexp",
                     "norm", "var", "std", "cumsum", "layer_norm", "rms_norm", "group_norm", "argmax",
                     "argmin", "prod", "all", "any"), _over_dims),
    **dict.fromkeys(("matmul", "bmm"), _matmul),
    "scaled_dot_product_attention": _sdpa,
}
