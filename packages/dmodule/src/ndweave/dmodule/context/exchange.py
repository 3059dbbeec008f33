"""The sequence's exchanges over CP: an all-gather whose gradient is a reduce-scatter."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndweave.mesh.collectives import all_gather_flat, reduce_scatter_flat
from ndweave.mesh.torch_compat import gather_traced, reduce_scatter_traced

__all__ = ["ATTENTION_BREAK", "GatherSequence", "gather", "reduce_scatter"]

#: Why ``torch.compile`` breaks a compiled block's graph at each attention inside ``cp.attention()``.
ATTENTION_BREAK = ("context parallel: attention gathers keys and values over the CP ranks (collectives in an "
                   "autograd function, blocks chosen by position); it runs eagerly between the block's graphs")


def gather(local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every CP rank's ``local`` concatenated on ``dim`` in rank order."""
    flat = local.movedim(dim, 0).contiguous()
    if local.is_meta:  # (a trace's: a collective the trace records, over the CP group's name)
        return gather_traced(flat, group).movedim(0, dim)
    out = flat.new_empty((dist.get_world_size(group) * flat.shape[0], *flat.shape[1:]))
    all_gather_flat(out, flat, group=group)
    return out.movedim(0, dim)


def reduce_scatter(whole: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's part (on ``dim``, rank order) of ``whole`` summed over the CP ranks."""
    flat = whole.movedim(dim, 0).contiguous()
    if whole.is_meta:
        return reduce_scatter_traced(flat, group).movedim(0, dim)
    out = flat.new_empty((flat.shape[0] // dist.get_world_size(group), *flat.shape[1:]))
    reduce_scatter_flat(out, flat, group=group)
    return out.movedim(0, dim)


class GatherSequence(torch.autograd.Function):
    """:func:`gather`; backward: each rank gets the sum, over every rank's use, of its own tokens'
    gradient (:func:`reduce_scatter`)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return gather(local, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter(grad, ctx.group, ctx.dim), None, None
