"""A plan's redistributions on a 1-D mesh as one collective each, in an autograd function of our own.

``DTensor.redistribute`` plans each move, builds and checks specs, and wraps the functional
collective in two autograd functions: ~0.3 ms of CPU above the all-gather itself for a sequence-
parallel activation on two ranks (torch 2.13, gloo), as much again as the collective. Yet a plan's
hooks move activations between few layouts, each one collective on the local tensor (Megatron's
sequence-parallel pair and its *f* / *g*):

====================  ======================  =================================================
from -> to            forward                 backward (the grad to the input's layout)
====================  ======================  =================================================
``Shard(d)`` -> ``R``   all-gather on d         ``Partial``: reduce-scatter on d; ``R``: the chunk
``Partial`` -> ``S(d)`` reduce-scatter on d     ``S(d)``: all-gather on d (to ``Replicate``)
``Partial`` -> ``R``    all-reduce              ``R``: as it is; ``S(d)``: all-gather on d
``R`` -> ``Shard(d)``   this rank's chunk       ``S(d)``: all-gather; ``Partial``: reduce-scatter
====================  ======================  =================================================

The grad goes where DTensor's own backward sends it (the input's layout, except that a ``Partial``
input's grad goes to ``Replicate`` unless it is ``Partial`` itself), through the same functional
collectives DTensor calls. Anything else (a mesh of several dims, uneven shards, another reduce op,
``async_op``, a compiled forward, a double backward) is ``DTensor.redistribute`` itself.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ndweave.mesh.torch_compat import dtensor_of, gather_on, local_tensor, reduce_scatter_on, sum_on

__all__ = ["redistribute"]


def redistribute(x: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
                 async_op: bool = False) -> DTensor:
    """``x.redistribute(mesh, placements, async_op=async_op)``, as one collective where the move is
    one of the module docstring's."""
    # (compiling first: comparing meshes would be guarded per module, each block compiled again)
    if (torch.compiler.is_compiling() or async_op or mesh.ndim != 1
            or (x.device_mesh is not mesh and x.device_mesh != mesh)):
        return x.redistribute(mesh, placements, async_op=async_op)
    dst = placements[0]
    if type(dst) is Shard and dst.dim < 0:
        dst = Shard(dst.dim % x.ndim)  # (as DTensor holds it)
    how = _collective(x.placements[0], dst, mesh.size(), x.shape)
    if how is None:
        return x.redistribute(mesh, placements, async_op=async_op)
    return _Redistribute.apply(x, mesh, dst, how)


def _collective(src: Placement, dst: Placement, n: int, shape: torch.Size) -> str | None:
    """Which move of the module docstring takes a tensor of (global) ``shape`` from ``src`` to ``dst``
    over ``n`` ranks, or ``None``. Shard dims are counted from the front (as DTensor holds them)."""
    for p in (src, dst):
        if type(p) is Shard and shape[p.dim] % n:  # (uneven: DTensor pads and unpads)
            return None
        if p.is_partial() and (type(p) is not Partial or p.reduce_op != "sum"):
            return None
    if type(src) is Shard and dst.is_replicate():
        return "all_gather"
    if src.is_partial() and type(dst) is Shard:
        return "reduce_scatter"
    if src.is_partial() and dst.is_replicate():
        return "all_reduce"
    if src.is_replicate() and type(dst) is Shard:
        return "chunk"
    return None


def _move(local: torch.Tensor, how: str, src: Placement, dst: Placement, mesh: DeviceMesh) -> torch.Tensor:
    """``local``, a piece laid out ``src``, moved to ``dst`` by ``how`` (:func:`_collective`'s
    answer), through the functional collectives DTensor itself calls."""
    if how == "chunk":
        return local.chunk(mesh.size(), dim=dst.dim)[mesh.get_local_rank()].contiguous()
    if how == "all_gather":
        return gather_on(local, src.dim, mesh.get_group())
    if how == "reduce_scatter":
        return reduce_scatter_on(local, dst.dim, mesh.get_group())
    return sum_on(local, mesh.get_group())


def _grad_layout(src: Placement, grad: Placement) -> Placement:
    """Where DTensor's backward of a redistribution from ``src`` sends a grad laid out ``grad``."""
    return Replicate() if src.is_partial() and not grad.is_partial() else src


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, mesh: DeviceMesh, dst: Placement, how: str) -> DTensor:
        ctx.mesh, ctx.src = mesh, x.placements[0]
        out = _move(local_tensor(x), how, ctx.src, dst, mesh)
        return dtensor_of(out, mesh, (dst,), x.shape, x.stride())

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple:
        mesh, current = ctx.mesh, grad.placements[0]
        target = _grad_layout(ctx.src, current)
        if current == target:
            return grad, None, None, None
        how = _collective(current, target, mesh.size(), grad.shape)
        if how is None or torch.is_grad_enabled():  # (a double backward: DTensor's own, differentiable)
            return grad.redistribute(mesh, (target,)), None, None, None
        moved = _move(local_tensor(grad), how, current, target, mesh)
        return dtensor_of(moved, mesh, (target,), grad.shape, grad.stride()), None, None, None
