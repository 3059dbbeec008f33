"""The contract between a data-parallel wrapper (``ndweave.ddp``) and a sharded optimizer
(``ndweave.optim``).

The wrapper keeps gradients in contiguous flat buffers split into buckets. With
``use_distributed_optimizer=True`` it reduce-scatters each bucket instead of all-reducing it, so that
after ``finish_grad_sync()`` data-parallel rank ``r`` holds the reduced gradient for
``shard_range(bucket.grad_data.numel(), dp_size, r)`` of every bucket, and it lays its parameters out
in a matching flat ``param_data`` buffer (each param's local tensor is a view into it). The sharded
optimizer keeps fp32 master weights and state for its ranges only, steps them, writes the result into
its range of ``param_data`` and all-gathers ``param_data`` over the data-parallel group.

Ranges ignore parameter boundaries (Megatron's layout): a parameter may be split between ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["BucketParam", "GradBucket", "GradBucketProvider", "shard_range"]


@dataclass(frozen=True)
class BucketParam:
    """Where one parameter lives inside a bucket."""

    name: str
    """Fully qualified name in the unwrapped model (no ``module.`` prefix)."""
    param: torch.nn.Parameter
    """The parameter itself; a DTensor when tensor-parallel (the buffer holds its local shard)."""
    offset: int
    """First element of the parameter's local tensor within the bucket's flat buffers."""
    numel: int
    """Number of local elements (``param.to_local().numel()`` for a DTensor)."""


@dataclass
class GradBucket:
    """One bucket of a data-parallel gradient buffer."""

    params: tuple[BucketParam, ...]
    """The parameters in the bucket, in buffer order. Elements no parameter covers are padding
    (zero); tensor-parallel peers see the same offsets even where their shards differ in size."""
    grad_data: torch.Tensor
    """1-D gradient buffer (may be fp32 for a bf16 model); numel divisible by the DP size."""
    param_data: torch.Tensor | None
    """1-D parameter buffer of the same numel whose views are the params' local tensors; set when the
    wrapper was built with ``use_distributed_optimizer=True``, else ``None``."""
    data_parallel_group: dist.ProcessGroup | None
    """Group the bucket is reduced over; ``None`` for a DP size of 1."""

    @property
    def data_parallel_size(self) -> int:
        return 1 if self.data_parallel_group is None else dist.get_world_size(self.data_parallel_group)

    @property
    def data_parallel_rank(self) -> int:
        return 0 if self.data_parallel_group is None else dist.get_rank(self.data_parallel_group)

    def shard_range(self, dp_rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of the bucket owned by ``dp_rank`` (default: this rank)."""
        rank = self.data_parallel_rank if dp_rank is None else dp_rank
        return shard_range(self.grad_data.numel(), self.data_parallel_size, rank)


def shard_range(numel: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Equal contiguous ranges; ``numel`` must divide by ``dp_size`` (buckets are padded so it does)."""
    if numel % dp_size:
        raise ValueError(f"a bucket of {numel} elements cannot be split evenly over {dp_size} data-parallel ranks")
    size = numel // dp_size
    return dp_rank * size, (dp_rank + 1) * size


@runtime_checkable
class GradBucketProvider(Protocol):
    """Implemented by ``ndweave.ddp.DistributedDataParallel``; consumed by sharded optimizers."""

    use_distributed_optimizer: bool

    def grad_buckets(self) -> Sequence[GradBucket]:
        """Every bucket of every dtype, in the order their reductions are launched."""
        ...

    def finish_grad_sync(self) -> None:
        """Wait for (or launch and wait for) every bucket's reduction; see ``GradSyncable``."""
        ...

    def zero_grad_buffer(self) -> None:
        """Zero all grad buffers and reset per-step state, ready for the next step."""
        ...
