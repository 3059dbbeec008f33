"""Contracts shared between ndweave packages.

Packages never import each other; where two must cooperate (DDP hands grad buckets to the sharded
optimizer, a pipeline schedule tells any data-parallel wrapper which micro-batch is the last, the
optimizer hands sharded state to checkpointing, every wrapper finishes its grad sync before a step)
they meet here, through small protocols and dataclasses owned by neither side.
"""

from ndweave.mesh.contracts.data_parallel import (
    DataParallelWrapper,
    GradReduction,
    MicroBatchControl,
    uses_distributed_optimizer,
)
from ndweave.mesh.contracts.grad_buckets import (
    BUCKET_ALIGNMENT,
    BucketParam,
    GradBucket,
    move_param_into,
    padded_bucket_numel,
    shard_range,
    slot_numel,
)
from ndweave.mesh.contracts.grad_sync import GradSyncable, finish_grad_sync, reduce_partial_grads
from ndweave.mesh.contracts.sharded_state import FlatShard, merge_flat_shards, slice_flat_shard
from ndweave.mesh.contracts.tied_params import is_tied_replica, mark_tied_replica

__all__ = [
    "BUCKET_ALIGNMENT",
    "BucketParam",
    "DataParallelWrapper",
    "FlatShard",
    "GradBucket",
    "GradReduction",
    "GradSyncable",
    "MicroBatchControl",
    "finish_grad_sync",
    "is_tied_replica",
    "mark_tied_replica",
    "merge_flat_shards",
    "move_param_into",
    "padded_bucket_numel",
    "reduce_partial_grads",
    "shard_range",
    "slice_flat_shard",
    "slot_numel",
    "uses_distributed_optimizer",
]
