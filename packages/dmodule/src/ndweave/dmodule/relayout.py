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

The hand-overs between DTensors and the plain tensors a plan hands on (``to_local``, ``from_local``)
are autograd functions of the same kind: ``DTensor.from_local`` builds and checks a spec each call,
and ``to_local``'s backward calls it again (~0.25 ms of CPU each, torch 2.13); here a DTensor is
built on a spec made once per layout (``torch_compat.dtensor_of``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ndweave.mesh.torch_compat import dtensor_of, gather_on, local_tensor, reduce_scatter_on, sum_on

__all__ = ["MeshFacts", "contiguous_stride", "dtensor_linears", "from_local", "mesh_facts", "redistribute",
           "through_dtensor", "to_local"]

_DTENSOR_ONLY = False  # dtensor_linears() sets it, for a block of code


def through_dtensor() -> bool:
    """Whether :func:`dtensor_linears` is on: the local paths step aside for DTensor's own ops."""
    return _DTENSOR_ONLY


@contextlib.contextmanager
def dtensor_linears() -> Iterator[None]:
    """Run every linear through DTensor (``F.linear`` on DTensors) inside the block, as before the local
    path, every module patched ``pointwise_local`` (Llama's sequence-parallel norms), and every
    redistribution and hand-over of the plan (``DTensor.redistribute``, ``from_local``,
    ``to_local``): to compare the two, or to debug with DTensor's own ops (``CommDebugMode``).
    Process-wide while the block runs (a forward on another thread sees it too)."""
    global _DTENSOR_ONLY
    previous, _DTENSOR_ONLY = _DTENSOR_ONLY, True
    try:
        yield
    finally:
        _DTENSOR_ONLY = previous


class MeshFacts(NamedTuple):
    """What a hot path reads of a 1-D mesh, read once: ``DeviceMesh``'s ``size()``, ``get_group()`` and
    ``get_local_rank()`` cost ~10-20 us of Python each a call (torch 2.13), several a collective."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    """This rank's coordinate on the mesh."""


_FACTS: dict[int, MeshFacts] = {}


def mesh_facts(mesh: DeviceMesh) -> MeshFacts:
    """``mesh``'s :class:`MeshFacts` (a 1-D mesh), kept by ``id`` with the mesh itself, so the id
    cannot name another mesh while the entry lives."""
    facts = _FACTS.get(id(mesh))
    if facts is None:
        if len(_FACTS) >= 256:  # (meshes made and dropped again and again: start over rather than grow)
            _FACTS.clear()
        facts = _FACTS[id(mesh)] = MeshFacts(mesh, mesh.get_group(), mesh.size(), mesh.get_local_rank())
    return facts


def redistribute(x: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
                 async_op: bool = False) -> DTensor:
    """``x.redistribute(mesh, placements, async_op=async_op)``, as one collective where the move is
    one of the module docstring's."""
    # (compiling first: comparing meshes would be guarded per module, each block compiled again)
    if (torch.compiler.is_compiling() or _DTENSOR_ONLY or async_op or mesh.ndim != 1
            or (x.device_mesh is not mesh and x.device_mesh != mesh)):
        return x.redistribute(mesh, placements, async_op=async_op)
    dst = placements[0]
    if type(dst) is Shard and dst.dim < 0:
        dst = Shard(dst.dim % x.ndim)  # (as DTensor holds it)
    how = _collective(x.placements[0], dst, mesh_facts(mesh).size, x.shape)
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
    facts = mesh_facts(mesh)
    if how == "chunk":
        return local.chunk(facts.size, dim=dst.dim)[facts.rank].contiguous()
    if how == "all_gather":
        return gather_on(local, src.dim, facts.group)
    if how == "reduce_scatter":
        return reduce_scatter_on(local, dst.dim, facts.group)
    return sum_on(local, facts.group)


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
        how = _collective(current, target, mesh_facts(mesh).size, grad.shape)
        if how is None or torch.is_grad_enabled():  # (a double backward: DTensor's own, differentiable)
            return grad.redistribute(mesh, (target,)), None, None, None
        moved = _move(local_tensor(grad), how, current, target, mesh)
        return dtensor_of(moved, mesh, (target,), grad.shape, grad.stride()), None, None, None


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def from_local(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
               shape: torch.Size | None = None) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, ...)``: the DTensor
    of this rank's ``local`` piece (an even one where ``shape``, the global shape, is not given), with
    its autograd (the grad laid out ``placements``, a ``Partial`` one's ``Replicate``, comes back as
    the local tensor). A 1-D mesh and a contiguous piece; otherwise torch's own."""
    p = placements[0] if len(placements) == 1 else None
    if (torch.compiler.is_compiling() or _DTENSOR_ONLY or mesh.ndim != 1 or type(p) not in (Shard, Replicate, Partial)
            or not local.is_contiguous() or local.device.type != mesh.device_type or isinstance(local, DTensor)):
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=None if shape is None else contiguous_stride(tuple(shape)))
    if type(p) is Shard and p.dim < 0:
        p = Shard(p.dim % local.ndim)
    if shape is None:
        shape = local.shape
        if type(p) is Shard:
            shape = (*shape[:p.dim], shape[p.dim] * mesh_facts(mesh).size, *shape[p.dim + 1:])
    return _FromLocal.apply(local, mesh, p, tuple(shape))


def to_local(x: DTensor, grad_placements: tuple[Placement, ...] | None = None) -> torch.Tensor:
    """``x.to_local(grad_placements=grad_placements)``, with its autograd: the plain grad that comes
    back is taken as laid out ``grad_placements`` (default: ``x``'s, a ``Partial`` one's ``Replicate``).
    A 1-D mesh; otherwise torch's own."""
    if torch.compiler.is_compiling() or _DTENSOR_ONLY or not torch.is_grad_enabled() or x.device_mesh.ndim != 1:
        return x.to_local(grad_placements=grad_placements)
    if grad_placements is None:
        grad_placements = tuple(Replicate() if p.is_partial() else p for p in x.placements)
    return _ToLocal.apply(x, tuple(grad_placements))


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: DeviceMesh, placement: Placement, shape: tuple) -> DTensor:
        ctx.mesh, ctx.placement = mesh, placement
        # (a fresh tensor object, out of autograd: the output's autograd metadata is not the caller's)
        return dtensor_of(local.detach(), mesh, (placement,), shape, contiguous_stride(shape))

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple:
        target = (Replicate() if ctx.placement.is_partial() else ctx.placement,)
        if torch.is_grad_enabled():  # (a double backward: torch's own, differentiable)
            return grad.redistribute(ctx.mesh, target).to_local(), None, None, None
        if grad.placements != target:
            grad = redistribute(grad, ctx.mesh, target)
        return local_tensor(grad), None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, grad_placements: tuple[Placement, ...]) -> torch.Tensor:
        ctx.mesh, ctx.grad_placements, ctx.shape = x.device_mesh, grad_placements, tuple(x.shape)
        local = local_tensor(x)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()  # (its global stride is then the contiguous one of its shape)
        stride = contiguous_stride(ctx.shape)
        if torch.is_grad_enabled():  # (a double backward: torch's own, differentiable)
            return DTensor.from_local(grad, ctx.mesh, ctx.grad_placements, shape=ctx.shape, stride=stride), None
        return dtensor_of(grad, ctx.mesh, ctx.grad_placements, ctx.shape, stride), None
