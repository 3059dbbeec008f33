"""What DDP holds while it syncs a chunk's grads, beyond its buffers, from the buffer plans alone
(:func:`~ndweave.ddp.buffer.plan_buffers`, the function DDP itself lays its buffers out with): what a
memory estimate adds to the buffers' own bytes, before anything is allocated.

    buffers = plan_buffers(params, bucket_size=bucket_size, grad_dtype_of=grad_dtype)
    sync = grad_sync(buffers, zero_stage=2)        # the full-size buckets each backward fills and reduces
    sync.in_flight, sync.reduce_copy               # bytes during a backward, and still reducing at its end
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ndweave.ddp.buffer import BufferPlan
from ndweave.ddp.grad_shard import MAX_IN_FLIGHT

__all__ = ["GradSync", "grad_dtype", "grad_sync", "published_grad_bytes"]


def grad_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype DDP keeps a parameter's grads in: at least fp32 (bf16 params, fp32 grads)."""
    return torch.promote_types(param_dtype, torch.float32)


@dataclass(frozen=True)
class GradSync:
    """What a chunk's grad sync holds beyond its buffers."""

    published: int
    """ZeRO-1: the ``.grad`` DDP hands out in the parameters' dtype where its buffer's is wider (bf16
    params, fp32 grads): a copy, held until the next ``zero_grad``."""
    reduce_copy: int
    """What reducing its buckets holds at the end of the chunk's backward beyond its grad buffers:
    with ZeRO-1 nothing (gloo all-reduces the buckets in place: ``ndweave.ddp.sync.reduces_by_all_reduce``;
    NCCL reduce-scatters them in place); with ZeRO-2 the full-size buckets still reducing (at most
    ``MAX_IN_FLIGHT`` of a buffer's largest)."""
    in_flight: int = 0
    """ZeRO-2: the full-size buckets each backward fills and reduces (``ndweave.ddp.grad_shard``: at
    most ``MAX_IN_FLIGHT`` reducing and one filling), on top of that backward's temporaries."""


def grad_sync(buffers: Sequence[BufferPlan], zero_stage: int = 1, published: int = 0) -> GradSync:
    """What syncing the grads of one chunk laid out in ``buffers`` holds beyond them, at ZeRO
    ``zero_stage``; ``published``: ZeRO-1's ``.grad`` copies (:func:`published_grad_bytes`), which
    ZeRO-2 never makes."""
    if zero_stage < 2:
        return GradSync(published, 0)
    in_flight = sum(min(MAX_IN_FLIGHT + 1, len(b.buckets)) * b.bucket_grad_bytes() for b in buffers)
    at_end = sum(min(MAX_IN_FLIGHT, len(b.buckets)) * b.bucket_grad_bytes() for b in buffers
                 if b.data_parallel_size > 1)
    return GradSync(0, at_end, in_flight)


def published_grad_bytes(params: Iterable[tuple[torch.dtype, int]]) -> int:
    """Bytes of the ``.grad`` copies ZeRO-1's DDP publishes for parameters of ``(dtype, local numel)``
    (each parameter once) whose grad buffer is wider than the parameter (:func:`grad_dtype`)."""
    return sum(numel * dtype.itemsize for dtype, numel in params if grad_dtype(dtype) != dtype)
