"""Contracts shared between ndweave packages.

Packages never import each other; where two must cooperate (DDP hands grad buckets to the sharded
optimizer, the optimizer hands sharded state to checkpointing, every wrapper finishes its grad sync
before a step) they meet here, through small protocols and dataclasses owned by neither side.
"""

from ndweave.mesh.contracts.grad_buckets import BucketParam, GradBucket, GradBucketProvider, shard_range
from ndweave.mesh.contracts.grad_sync import GradSyncable, finish_grad_sync, reduce_partial_grads
from ndweave.mesh.contracts.sharded_state import FlatShard, merge_flat_shards, slice_flat_shard

__all__ = [
    "BucketParam",
    "FlatShard",
    "GradBucket",
    "GradBucketProvider",
    "GradSyncable",
    "finish_grad_sync",
    "merge_flat_shards",
    "reduce_partial_grads",
    "shard_range",
    "slice_flat_shard",
]
