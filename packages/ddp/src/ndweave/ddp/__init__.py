"""ndweave.ddp: data parallelism over the DP mesh dim, DTensor-aware, bucketed and overlapped.

    from ndweave.ddp import DDP
    model = DDP(model, DEVICE_MESH["DP"])
"""

from ndweave.ddp.desync import GradSyncDivergedError
from ndweave.ddp.distributed_data_parallel import DDP, DEFAULT_BUCKET_SIZE, DistributedDataParallel

__version__ = "0.10.0"

__all__ = ["DDP", "DEFAULT_BUCKET_SIZE", "DistributedDataParallel", "GradSyncDivergedError", "__version__"]
