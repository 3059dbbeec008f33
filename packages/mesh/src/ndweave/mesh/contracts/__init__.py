"""Contracts shared between ndweave packages.

Packages never import each other; where two must cooperate (DDP hands grad buckets to the sharded
optimizer, a pipeline schedule tells any data-parallel wrapper which micro-batch is the last, the
optimizer hands sharded state to checkpointing in one format, every wrapper finishes its grad sync
before a step, a pipeline stage says which modules it removed so whole-model plans still apply)
they meet here, through small protocols and dataclasses owned by neither side.
"""

from ndweave.mesh.contracts.data_parallel import (
    DataParallelWrapper,
    GradReduction,
    MicroBatchControl,
    rank_slice,
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
from ndweave.mesh.contracts.grad_sync import (CheckedStepSync, GradSyncable, StepWaiter, finish_grad_sync,
                                             finish_grad_sync_for_step, reduce_partial_grads)
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
from ndweave.mesh.contracts.removed_modules import mark_removed_modules, removed_modules
from ndweave.mesh.contracts.tied_params import is_tied_replica, mark_tied_replica, tied_primary

__all__ = [
    "BUCKET_ALIGNMENT",
    "BucketParam",
    "CheckedStepSync",
    "DataParallelWrapper",
    "GradBucket",
    "GradReduction",
    "GradSyncable",
    "MASTER_KEY",
    "MicroBatchControl",
    "SCALAR_KEYS",
    "ShardLayout",
    "StatePiece",
    "StepWaiter",
    "finish_grad_sync",
    "finish_grad_sync_for_step",
    "from_torch_state_dict",
    "is_elementwise",
    "is_tied_replica",
    "mark_removed_modules",
    "mark_tied_replica",
    "merge_pieces",
    "merge_state_dicts",
    "move_param_into",
    "padded_bucket_numel",
    "rank_slice",
    "reduce_partial_grads",
    "removed_modules",
    "reshard_pieces",
    "resolve_state_value",
    "shard_range",
    "slice_piece",
    "slot_numel",
    "tied_primary",
    "to_torch_state_dict",
    "union_state_dicts",
    "uses_distributed_optimizer",
]


def __getattr__(name: str):
    # the estimate vocabulary moved to ndweave-plan in mesh 0.10; its old names resolve for one release
    if name in ("MemoryTerm", "RankMemory", "StepTime", "TimeTerm"):
        from ndweave.mesh._moved import moved

        return moved(f"ndweave.mesh.contracts.{name}", "ndweave.plan.estimate", name, distribution="ndweave-plan")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
