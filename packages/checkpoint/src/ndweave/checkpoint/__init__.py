"""ndweave.checkpoint: save nD-parallel training on one mesh, resume it on any other.

``save(path, state)`` / ``load(path, state)`` on torch's distributed checkpoint (DCP) format, keyed by
the original model's FQNs; sharded optimizer state stored as chunks of one global tensor per key;
atomic commits; asynchronous saves; ``CheckpointManager`` for step folders; ``export`` to one torch
file or HF-style safetensors; ``DataPosition`` to resume the data at any data-parallel size.
"""

from ndweave.checkpoint.buffers import StagingBuffers
from ndweave.checkpoint.data_position import DataPosition, PositionSampler, rank_slice
from ndweave.checkpoint.errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from ndweave.checkpoint.exporter import export
from ndweave.checkpoint.loader import LoadResult, load
from ndweave.checkpoint.manager import CheckpointManager
from ndweave.checkpoint.saver import SaveHandle, save

__version__ = "0.4.2"

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "DataPosition",
    "LoadResult",
    "PositionSampler",
    "SaveHandle",
    "StagingBuffers",
    "__version__",
    "export",
    "load",
    "rank_slice",
    "save",
]
