"""``nn.Linear`` under tensor parallelism, computed on local shards in one autograd function.

DTensor runs ``F.linear`` on a (batch, seq, in) input as a transpose, views and a matmul, and its
backward as as many again, each op looking up its sharding: about 0.35 ms of CPU per linear per
forward and backward on CPU (torch 2.13), as much as the matmuls of a small model, and on a GPU time
the device waits. Yet a tensor-parallel plan gives a linear few layouts, and each fixes where the
output and every grad lie (Megatron's column- and row-parallel linears). For those, ``parallelize_module``
gives each ``nn.Linear`` holding a DTensor weight a class whose forward computes them directly: the
same matmuls on the local tensors, DTensors only at its inputs and outputs, so plans, hooks, grads and
everything downstream see what DTensor would have given them.

On a 1-D mesh (``S(d)`` = ``Shard(d)``; the input's last dim is ``in``):

=============  =================  ==========  ==========  ===========  ======================
weight         input              output      input grad  weight grad  bias (and its grad)
=============  =================  ==========  ==========  ===========  ======================
``S(0)``       ``Replicate``      ``S(-1)``   ``Partial`` ``S(0)``     ``S(0)``
``S(1)``       ``S(-1)``          ``Partial`` ``S(-1)``   ``S(1)``     ``Replicate``, added on
                                                                       mesh rank 0 only
``Replicate``  ``Replicate``      same        same        ``Replicate`` ``Replicate``
``Replicate``  ``S(d)``, d < -1   ``S(d)``    ``S(d)``    ``Partial``  ``Replicate`` (grad
                                                                       ``Partial``)
=============  =================  ==========  ==========  ===========  ======================

A ``Partial`` grad reaching a replicated linear (a LoRA adapter's, from the sharded adapter after it)
flows through it, every grad ``Partial``, as DTensor carries it. Anything else (a mesh of several
dims, a ``Partial`` or plain input, an unplanned bias layout), and every compiled (the graph is
DTensor's, as torch's own tensor parallel compiles) or autocast forward, runs ``F.linear`` on
DTensors as before. :func:`dtensor_linears` turns the local path off, to compare
or debug.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ndweave.dmodule.relayout import contiguous_stride, dtensor_linears, mesh_facts, redistribute, through_dtensor
from ndweave.mesh.torch_compat import dtensor_of, local_tensor

__all__ = ["dtensor_linears", "linear", "through_dtensor", "use_local_linears"]


class _Rule(NamedTuple):
    output: tuple[Placement, ...]
    grad_output: tuple[Placement, ...]
    """What the output's grad must be (``Partial`` output: ``Replicate``, as DTensor's)."""
    grad_input: tuple[Placement, ...]
    grad_weight: tuple[Placement, ...]
    grad_bias: tuple[Placement, ...]
    bias_once: bool
    """The output is ``Partial``: the bias is added on mesh rank 0 only."""


_R, _P = (Replicate(),), (Partial(),)
_ALL_PARTIAL = _Rule(_R, _P, _P, _P, _P, False)
_RULES: dict[tuple, _Rule | None] = {}


def _rule(x: Placement, w: Placement, b: Placement | None, ndim: int) -> _Rule | None:
    key = (x, w, b, ndim)
    if key not in _RULES:
        _RULES[key] = _derive(x, w, b, ndim)
    return _RULES[key]


def _derive(x: Placement, w: Placement, b: Placement | None, ndim: int) -> _Rule | None:
    last = ndim - 1
    x_dim = x.dim % ndim if type(x) is Shard else None  # (not _StridedShard: its pieces interleave)
    if type(w) is Shard and w.dim == 0 and x.is_replicate() and b in (None, w):  # column parallel
        out = (Shard(last),)
        return _Rule(out, out, _P, (w,), (w,), False)
    if type(w) is Shard and w.dim == 1 and x_dim == last and (b is None or b.is_replicate()):  # row parallel
        return _Rule(_P, _R, (Shard(last),), (w,), _R, True)
    if w.is_replicate() and (b is None or b.is_replicate()):
        if x.is_replicate():
            return _Rule(_R, _R, _R, _R, _R, False)
        if x_dim is not None and x_dim != last:  # rows split (batch, sequence): the weight's grad sums them
            out = (Shard(x_dim),)
            return _Rule(out, out, out, _P, _P, False)
    return None


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)``, on local shards where the layouts are one of the module
    docstring's; otherwise ``F.linear`` itself."""
    if (through_dtensor() or not isinstance(input, DTensor) or not isinstance(weight, DTensor)
            or torch.compiler.is_compiling() or _autocast(input.device.type)):
        return F.linear(input, weight, bias)
    mesh = weight.device_mesh
    other = input.device_mesh
    if (mesh.ndim != 1 or (other is not mesh and other != mesh) or (bias is not None and not isinstance(bias, DTensor))
            or input.shape[-1:] != weight.shape[1:]):  # (a wrong width: DTensor's error, which op_errors explains)
        return F.linear(input, weight, bias)
    rule = _rule(input.placements[0], weight.placements[0], None if bias is None else bias.placements[0], input.ndim)
    if rule is None:
        return F.linear(input, weight, bias)
    return _LocalLinear.apply(input, weight, bias, rule)


def _autocast(device_type: str) -> bool:
    return device_type != "meta" and torch.is_autocast_enabled(device_type)  # (meta has no autocast)


class _LocalLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, w: DTensor, b: DTensor | None, rule: _Rule) -> DTensor:
        mesh = w.device_mesh
        xl, wl = local_tensor(x), local_tensor(w)
        bl = None
        if b is not None and (not rule.bias_once or mesh_facts(mesh).rank == 0):
            bl = local_tensor(b)
        y = F.linear(xl, wl, bl)
        ctx.save_for_backward(xl, wl)
        ctx.rule, ctx.mesh, ctx.x_shape = rule, mesh, tuple(x.shape)
        ctx.w_layout = tuple(w.shape), w.stride()
        ctx.b_layout = None if b is None else (tuple(b.shape), b.stride())
        shape = (*x.shape[:-1], w.shape[0])
        return dtensor_of(y, mesh, rule.output, shape, contiguous_stride(shape))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: DTensor) -> tuple:
        rule, mesh = ctx.rule, ctx.mesh
        if rule.output == _R and grad.placements == _P:
            # a replicated linear is linear in its grad: a Partial one flows through, every grad Partial
            # (as DTensor carries it: a LoRA adapter's, summed once where it meets the sharded path's)
            rule = _ALL_PARTIAL
        elif tuple(grad.placements) != rule.grad_output:
            grad = redistribute(grad, mesh, rule.grad_output)
        xl, wl = ctx.saved_tensors
        g = local_tensor(grad)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = dtensor_of(g.matmul(wl), mesh, rule.grad_input, ctx.x_shape, contiguous_stride(ctx.x_shape))
        rows = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = dtensor_of(rows.t().mm(xl.reshape(-1, xl.shape[-1])), mesh, rule.grad_weight, *ctx.w_layout)
        if ctx.b_layout is not None and ctx.needs_input_grad[2]:
            gb = dtensor_of(rows.sum(0), mesh, rule.grad_bias, *ctx.b_layout)
        return gx, gw, gb, None


def forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """The forward of a local linear (named ``forward``: ``op_errors`` finds a module's frame by it)."""
    return linear(input, self.weight, self.bias)


_CLASSES: dict[type, type] = {}


def use_local_linears(module: nn.Module) -> None:
    """Give every ``nn.Linear`` in ``module`` (its class or a subclass keeping ``nn.Linear``'s forward)
    whose weight is a DTensor the forward of :func:`linear`: a subclass of its own class, so
    ``isinstance``, its name, FQNs and ``state_dict`` are unchanged."""
    for sub in module.modules():
        cls = type(sub)
        if cls.forward is not nn.Linear.forward or not isinstance(getattr(sub, "weight", None), DTensor):
            continue
        local = _CLASSES.get(cls)
        if local is None:
            local = _CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        sub.__class__ = local
