"""The rules for ops that move the sharded dim (view / reshape / transpose / permute / (un)squeeze /
expand ...) and that index, split or join along dims (getitem / split / chunk / unbind / cat /
stack): see :mod:`ndweave.dmodule.infer.ops`. ``SHAPE_RULES`` maps each op's base name to its rule."""

from __future__ import annotations

import math
from typing import Any, Callable

from ndweave.dmodule.infer.cuts import (Cut, Cuts, Pieces, Shapes, Unsupported, arg, base_name, norm_dim, one_output,
                                        single_input, sizes)
from ndweave.dmodule.infer.trace import Op, Ref

__all__ = ["SHAPE_RULES", "reshape_cut"]


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
    vid, cut = single_input(op, sharded)
    return one_output(op, reshape_cut(shapes[vid], shapes[op.outputs[0]], cut))


def _transpose(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = single_input(op, sharded)
    dim = cut.dim
    ndim = len(shapes[vid])
    if base_name(op.name) == "t":
        a, b = 0, ndim - 1
    else:
        a, b = (norm_dim(arg(op, i, n), ndim) for i, n in ((1, "dim0"), (2, "dim1")))
    return one_output(op, cut.at(b if dim == a else a if dim == b else dim))


def _permute(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = single_input(op, sharded)
    ndim = len(shapes[vid])
    order = [norm_dim(d, ndim) for d in sizes(op.args[1:] or (op.kwargs["dims"],))]
    return one_output(op, cut.at(order.index(cut.dim)))


def _movedim(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = single_input(op, sharded)
    ndim = len(shapes[vid])
    src, dst = arg(op, 1, "source"), arg(op, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src, dst = [norm_dim(d, ndim) for d in src], [norm_dim(d, ndim) for d in dst]
    order = [None] * ndim
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(d for d in range(ndim) if d not in src)
    order = [next(rest) if o is None else o for o in order]
    return one_output(op, cut.at(order.index(cut.dim)))


def _same_dims(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    """expand / ``*_like`` factories and other ops keeping every dim where it is (new leading dims
    allowed); the cut dim must keep its size."""
    vid, cut = single_input(op, sharded)
    out = shapes[op.outputs[0]]
    offset = len(out) - len(shapes[vid])
    if offset < 0 or shapes[vid][cut.dim] != out[cut.dim + offset]:
        raise Unsupported(f"{op.name} changes the sharded dim")
    return one_output(op, cut.at(cut.dim + offset))


def _repeat_interleave(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = single_input(op, sharded)
    along = arg(op, 2, "dim")
    if along is None or not isinstance(arg(op, 1, "repeats"), int) or cut.outer != 1:
        raise Unsupported(f"{op.name} without an int count and a dim")
    if norm_dim(along, len(shapes[vid])) != cut.dim:
        return one_output(op, cut)
    # each element repeated in place: a rank's contiguous block stays its own
    return one_output(op, cut)


def _unsqueeze(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = single_input(op, sharded)
    new = norm_dim(arg(op, 1, "dim"), len(shapes[vid]) + 1)
    return one_output(op, cut.at(cut.dim + 1 if new <= cut.dim else cut.dim))


def _as_complex(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    """view_as_complex drops a last dim of 2, view_as_real adds one: other dims stay."""
    vid, cut = single_input(op, sharded)
    if cut.dim >= len(shapes[op.outputs[0]]):
        raise Unsupported(f"{op.name} of the sharded dim")
    return one_output(op, cut)


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
            return one_output(op, cut.at(out_dim))
        in_dim += 1
        out_dim += 0 if isinstance(item, int) else 1
    raise Unsupported("index parsing")


def _split(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts | Pieces:
    vid, cut = single_input(op, sharded)
    dim = cut.dim
    shape = shapes[vid]
    along = norm_dim(arg(op, 2, "dim", 0), len(shape))
    base = base_name(op.name)
    if along != dim:
        return {out: cut for out in op.outputs}
    if base == "unbind":
        raise Unsupported("unbind along the sharded dim")
    sizes = [shapes[out][dim] for out in op.outputs]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return Pieces(dim, tuple((s, s + n) for s, n in zip(starts, sizes)))


def _unbind(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    vid, cut = single_input(op, sharded)
    along = norm_dim(arg(op, 1, "dim", 0), len(shapes[vid]))
    if along == cut.dim:
        raise Unsupported("unbind along the sharded dim")
    return {out: cut.at(cut.dim - (along < cut.dim)) for out in op.outputs}


def _cat(op: Op, sharded: Cuts, shapes: Shapes) -> Cuts:
    tensors = [r.id for r in op.args[0] if isinstance(r, Ref)] if op.args else []
    tensors = [v for v in tensors if math.prod(shapes[v]) > 0]  # torch.cat skips empty (0,) tensors
    ndim = len(shapes[op.outputs[0]])
    stack = base_name(op.name) == "stack"
    along = norm_dim(arg(op, 1, "dim", 0), ndim)
    cuts = {sharded.get(v) for v in tensors}
    if len(cuts) != 1 or None in cuts:
        raise Unsupported(f"{op.name} of sharded and unsharded values")
    cut = cuts.pop()
    if stack:
        return one_output(op, cut.at(cut.dim + 1 if along <= cut.dim else cut.dim))
    if along == cut.dim:
        raise Unsupported(f"{op.name} along the sharded dim")
    return one_output(op, cut)


SHAPE_RULES: dict[str, Callable[[Op, Cuts, Shapes], "Cuts | Pieces"]] = {
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
}
