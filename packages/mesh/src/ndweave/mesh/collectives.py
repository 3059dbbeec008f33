"""Flat-tensor collectives under the name each torch version prefers.

torch 2.13 deprecates ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` in favour of
``reduce_scatter_single`` / ``all_gather_single``, which older releases (2.11, say) lack. DDP and the
sharded optimizer both move flat buckets this way, so the choice is made here, once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, *, op=dist.ReduceOp.SUM,
                        group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    """Reduce ``input`` over ``group``; this rank's equal part lands in ``output`` (may alias ``input``)."""
    return _REDUCE_SCATTER(output, input, op=op, group=group, async_op=async_op)


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                    async_op: bool = False) -> dist.Work | None:
    """Concatenate every rank's ``input`` into ``output`` in rank order (``input`` may be a view of it)."""
    return _ALL_GATHER(output, input, group=group, async_op=async_op)
