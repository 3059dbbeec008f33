"""Check a block on the shapes one rank sees, and find the head counts its forward reshapes with.

A block whose ops run on local tensors (heads, attention) only works if the model's forward derives
every size from the tensors it is given (``view(B, T, -1, head_dim)``). Many forwards instead use a
literal: ``view(B, T, self.num_heads, head_dim)``, ``split(self.split_size)``, ``qkv[..., :
self.config.num_attention_heads * head_dim]``. Those attributes must be divided by the TP size.

:func:`verify_block` re-runs the block's module alone on meta (on fake tensors if the trace was), as
one rank of a ``tp``-way mesh would (its inputs as recorded; a column's output cut to this rank's
features, a row's input given back whole, a fused column computed on its local parameters), and
compares every op's output shape with the shape expected from the global trace (the sharded dim
divided by ``tp``). Where they differ it tries dividing int attributes of the module (and of the
configs it holds) whose value is one of the block's sharded sizes and one of the literal sizes of
the op that went wrong, keeping each that gets the run further, until every shape matches. The names
come from the values observed, never from a list of known names.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ndweave.dmodule.infer.emit import block_module
from ndweave.dmodule.infer.modules import Boundaries, is_within
from ndweave.dmodule.infer.patches import divide_attributes
from ndweave.dmodule.infer.patterns import Block
from ndweave.dmodule.infer.trace import Ref, Trace, fake_mode_of, meta_copy, record, shape_only
from ndweave.mesh.torch_compat import torch_function_disabled

__all__ = ["Verdict", "verify_block"]

_MAX_ATTRIBUTES = 3


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`verify_block`."""

    attributes: tuple[str, ...] | None
    """Attributes to divide by the TP size (dotted paths from the block's module; ``()``: none),
    or ``None`` when no set of them makes every local shape right."""
    why: str
    """What was found, or why the block fails."""


class _Mesh:
    """Stands in for a 1-D mesh of ``size`` ranks when the patches run on a meta copy."""

    ndim = 1

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def __str__(self) -> str:
        return f"a simulated {self._size}-rank mesh"


def _tp(block: Block) -> int | None:
    """The smallest TP size > 1 dividing every sharded size of the block."""
    sizes = sorted(block.sizes)
    for tp in range(2, (sizes[0] if sizes else 1) + 1):
        if all(s % tp == 0 for s in sizes):
            return tp
    return None


@dataclass(frozen=True)
class _Problem:
    """Where one rank's forward first goes wrong."""

    position: int
    """Index among the compared ops (a later one means progress)."""
    message: str
    literals: frozenset[int]
    """The ints among that op's arguments: the literal sizes an attribute may have fed."""


def verify_block(block: Block, b: Boundaries, model: nn.Module) -> Verdict:
    """Whether ``block`` computes the expected local shapes, and which attributes make it so.

    Greedy: run one rank's forward; at the first op that goes wrong, try each attribute whose value
    is one of that op's literal sizes (or divides one, a head count inside ``heads * head_dim``) and
    keep the first that gets further; repeat until every shape is right."""
    tp = _tp(block)
    if tp is None:
        return Verdict(None, f"its sharded sizes {sorted(block.sizes)} have no common divisor above 1 (a single "
                             "key/value head, say): no tensor-parallel size splits every one")
    fqn = block_module(block)
    call = b.calls.get(fqn)
    if call is None:
        return Verdict(None, f"{fqn or '<root>'} was not called as a module")
    module = model.get_submodule(fqn)
    candidates = _candidates(module, block)
    names: tuple[str, ...] = ()
    problem = _run_local(block, b, module, fqn, call, tp, names)
    first = problem
    for _ in range(_MAX_ATTRIBUTES):
        if problem is None:
            break
        exact = [c for c, v in candidates.items() if v in problem.literals and c not in names]
        dividing = [c for c, v in candidates.items() if c not in names and c not in exact
                    and any(n % v == 0 for n in problem.literals)]
        for name in exact + dividing:
            attempt = _run_local(block, b, module, fqn, call, tp, (*names, name))
            if attempt is None or attempt.position > problem.position:
                names, problem = (*names, name), attempt
                break
        else:
            break
    if problem is None:
        return Verdict(names, f"dividing {', '.join(names)} by the TP size" if names
                       else "its reshapes follow the local shapes")
    tried = ", ".join(candidates) or "none has a sharded size as value"
    return Verdict(None, f"{first.message}; dividing its int attributes ({tried}) by the TP size does not fix that")


def _candidates(module: nn.Module, block: Block) -> dict[str, int]:
    """Dotted path -> value of the int attributes under ``module`` (its submodules and the plain
    objects it holds, a config) whose value is one of the block's sharded sizes."""
    found: dict[str, int] = {}
    for sub_name, sub in module.named_modules():
        prefix = f"{sub_name}." if sub_name else ""
        for name, value in vars(sub).items():
            if name.startswith("_"):
                continue
            if type(value) is int and value in block.sizes:
                found[prefix + name] = value
            elif _plain_object(value):
                found.update({f"{prefix}{name}.{k}": v for k, v in vars(value).items()
                              if not k.startswith("_") and type(v) is int and v in block.sizes})
    return found


def _plain_object(value: Any) -> bool:
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type))
            and not callable(value))


def _run_local(block: Block, b: Boundaries, module: nn.Module, fqn: str, call: Any, tp: int,
               names: tuple[str, ...]) -> _Problem | None:
    """Run one rank's view of the block; ``None`` if every shape is as expected."""
    fake_mode = fake_mode_of(module)  # the trace ran on fake tensors: a forward that fails on meta
    local = meta_copy(module, fake_mode)
    if names:
        divide_attributes(local, _Mesh(tp), fqn, names=list(names))
    handles = _localize(local, fqn, block, tp)
    got = Trace()
    try:
        with torch.no_grad():
            record(got, local, _inputs(call.args, b, fake_mode), _inputs(call.kwargs, b, fake_mode))
    except Exception as error:  # noqa: BLE001 (any failure of the model's code is the answer)
        earlier = _compare(block, b, call, got, fqn, tp, partial=True)  # a wrong shape before the failure
        if earlier is not None:
            return earlier
        failed = got.ops[-1] if got.ops else None
        return _Problem(len(_compared(got.leaves(), block, fqn, local=True)) - 1,
                        f"one rank's forward of {fqn or '<root>'} fails ({type(error).__name__}: {str(error)[:160]})",
                        _ints(failed.args) if failed else frozenset())
    finally:
        for h in handles:
            h.remove()
    return _compare(block, b, call, got, fqn, tp)


def _ints(obj: Any) -> frozenset[int]:
    if type(obj) is int:
        return frozenset((obj,))
    if isinstance(obj, (tuple, list)):
        return frozenset().union(*map(_ints, obj)) if obj else frozenset()
    if isinstance(obj, slice):
        return _ints((obj.start, obj.stop))
    return frozenset()


def _localize(local: nn.Module, fqn: str, block: Block, tp: int) -> list[Any]:
    """Make ``local`` (a meta copy of the block's module) see what one rank sees."""
    handles = []
    prefix = f"{fqn}." if fqn else ""

    def rel(name: str) -> str:
        return "" if name == fqn else name[len(prefix):] if prefix and name.startswith(prefix) else name

    def shrink(param_fqn: str, dim: int) -> None:
        owner, _, leaf = rel(param_fqn).rpartition(".")
        sub = local.get_submodule(owner)
        p = getattr(sub, leaf)
        shape = list(p.shape)
        shape[dim] //= tp
        setattr(sub, leaf, nn.Parameter(p.new_empty(shape)))  # (meta or fake, as ``p``)

    if block.container is not None:  # local_block: the module runs whole on its local shards
        cuts = {c.weight: c.out_dim for c in block.columns} | {c.bias: 0 for c in block.columns if c.bias}
        cuts |= {r.weight: r.in_dim for r in block.rows}  # (an expert's weight is used once per expert)
        for name, dim in cuts.items():
            shrink(name, dim)
        return handles
    for column in block.columns:
        sub = local.get_submodule(rel(column.module))
        if column.op in block.pieces:  # the fused_colwise patch: the module runs on its local parameters
            shrink(column.weight, column.out_dim)
            if column.bias is not None:
                shrink(column.bias, 0)
        else:  # runs on DTensors (global shapes); its output is then cut to this rank's features
            handles.append(sub.register_forward_hook(lambda m, a, out: _cut_last(out, tp)))
    for row in block.rows:  # its input is given back as a DTensor of the global shape
        sub = local.get_submodule(rel(row.module))
        handles.append(sub.register_forward_pre_hook(lambda m, a: (_grow_last(a[0], tp), *a[1:])))
    return handles


def _cut_last(out: torch.Tensor, tp: int) -> torch.Tensor:
    with torch_function_disabled():  # the simulation's own tensors are not the model's ops
        return out.new_empty((*out.shape[:-1], out.shape[-1] // tp))


def _grow_last(x: torch.Tensor, tp: int) -> torch.Tensor:
    with torch_function_disabled():
        return x.new_empty((*x.shape[:-1], x.shape[-1] * tp))


def _inputs(plain: Any, b: Boundaries, fake_mode: Any) -> Any:
    """Meta (or fake) tensors for the recorded arguments; opaque objects (a cache) become ``None``."""
    if isinstance(plain, Ref):
        v = b.trace.values[plain.id]
        return shape_only(v.shape, v.dtype, fake_mode)
    if isinstance(plain, tuple):
        return tuple(_inputs(x, b, fake_mode) for x in plain)
    if isinstance(plain, list):
        return [_inputs(x, b, fake_mode) for x in plain]
    if isinstance(plain, dict):
        return {k: _inputs(v, b, fake_mode) for k, v in plain.items()}
    if isinstance(plain, str) and plain.startswith("<") and plain.endswith(">"):
        return None
    return plain


def _compared(ops: list, block: Block, fqn: str, local: bool) -> list:
    """The ops to compare: not those inside a column or row that runs on DTensors (global shapes).
    ``local``: ``ops`` come from the block's module traced alone (FQNs relative to it)."""
    inside = [column.module for column in block.columns if column.op not in block.pieces]
    inside += [row.module for row in block.rows]
    if block.container is not None:
        inside = []
    if local:
        cut = len(fqn) + 1 if fqn else 0
        inside = [m[cut:] for m in inside]
    return [op for op in ops if not any(is_within(op.module, m) for m in inside)]


def _compare(block: Block, b: Boundaries, call: Any, got: Trace, fqn: str, tp: int,
             partial: bool = False) -> _Problem | None:
    """The first op whose output shape differs from the global trace's with sharded dims divided.
    Ops are paired by aligning the two sequences of op names: a call one run makes and the other
    does not (a key/value cache the recorded call had and this run has not) is skipped.
    ``partial``: ``got`` stops where one rank's forward raised."""
    want_ops = _compared([op for op in b.trace.leaves() if call.first_op <= op.index < call.end_op], block, fqn, False)
    got_ops = _compared(got.leaves(), block, fqn, True)
    matcher = difflib.SequenceMatcher(None, [op.name for op in want_ops], [op.name for op in got_ops], autojunk=False)
    for i, j, size in matcher.get_matching_blocks():
        for want, have, position in zip(want_ops[i:i + size], got_ops[j:j + size], range(j, j + size)):
            if partial and not have.outputs:  # the call that raised
                break
            if want.inputs and b.trace.values[want.inputs[0]].param is not None:
                continue  # a parameter taken apart (an expert's slice): this rank's shard, not an activation
            for w, h in zip(want.outputs, have.outputs):
                shape = list(b.trace.values[w].shape)
                if w in block.values:
                    shape[block.values[w].dim] //= tp
                if tuple(shape) != got.values[h].shape:
                    return _Problem(position, f"{want.name} in {want.module or '<root>'} gives {got.values[h].shape} "
                                              f"on one of {tp} ranks, not {tuple(shape)}", _ints(have.args))
    matched = sum(size for _, _, size in matcher.get_matching_blocks())
    if not partial and matched < len(want_ops) // 2:
        return _Problem(0, f"one rank's forward of {fqn or '<root>'} runs other ops than the whole model's",
                        frozenset())
    return None
