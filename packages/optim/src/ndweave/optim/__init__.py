"""ndweave.optim: a Megatron-style sharded optimizer that composes with DDP and tensor parallelism,
and a basic one that finishes every grad sync before stepping.

    from ndweave.optim import DistributedOptimizer, BasicOptimizer

    opt = DistributedOptimizer(torch.optim.Adam, models=[ddp_model], optimizer_kwargs={"lr": 1e-3})
    opt.zero_grad(); loss.backward(); opt.step()
"""

# the state format lives in mesh's contracts (ndweave.checkpoint reads it without importing us)
from ndweave.mesh.contracts.optimizer_state import (
    MASTER_KEY,
    from_torch_state_dict,
    merge_state_dicts,
    to_torch_state_dict,
)
from ndweave.optim.base import NonFiniteGradError
from ndweave.optim.basic_optimizer import BasicOptimizer
from ndweave.optim.distributed_optimizer import DistributedOptimizer
from ndweave.optim.inner import ELEMENTWISE_OPTIMIZERS, NON_ELEMENTWISE_OPTIMIZERS
from ndweave.optim.loss_scale import DynamicLossScaler
from ndweave.optim.state_check import StateDictMismatchError

__version__ = "0.8.0"

__all__ = [
    "BasicOptimizer",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "ELEMENTWISE_OPTIMIZERS",
    "MASTER_KEY",
    "NON_ELEMENTWISE_OPTIMIZERS",
    "NonFiniteGradError",
    "StateDictMismatchError",
    "from_torch_state_dict",
    "merge_state_dicts",
    "to_torch_state_dict",
    "__version__",
]
