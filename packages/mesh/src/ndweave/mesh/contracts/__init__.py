"""Contracts shared between ndweave packages.

Packages never import each other; where two must cooperate (DDP hands grad buckets to the sharded
optimizer, the optimizer hands sharded state to checkpointing in one format, every wrapper finishes its grad sync
before a step) they meet here, through small protocols and dataclasses owned by neither side.
"""

from ndweave.mesh.contracts.grad_buckets import BucketParam, GradBucket, GradBucketProvider, shard_range
from ndweave.mesh.contracts.grad_sync import GradSyncable, finish_grad_sync, reduce_partial_grads
from ndweave.mesh.contracts.optimizer_state import (
    MASTER_KEY,
    SCALAR_KEYS,
    from_torch_state_dict,
    is_elementwise,
    merge_state_dicts,
    resolve_state_value,
    to_torch_state_dict,
    union_state_dicts,
)
from ndweave.mesh.contracts.sharded_state import (
    ShardLayout,
    StatePiece,
    merge_pieces,
    reshard_pieces,
    slice_piece,
)

__all__ = [
    "BucketParam",
    "GradBucket",
    "GradBucketProvider",
    "GradSyncable",
    "MASTER_KEY",
    "SCALAR_KEYS",
    "ShardLayout",
    "StatePiece",
    "finish_grad_sync",
    "from_torch_state_dict",
    "is_elementwise",
    "merge_pieces",
    "merge_state_dicts",
    "reduce_partial_grads",
    "reshard_pieces",
    "resolve_state_value",
    "shard_range",
    "slice_piece",
    "to_torch_state_dict",
    "union_state_dicts",
]
