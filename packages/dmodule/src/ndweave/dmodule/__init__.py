"""ndweave.dmodule: tensor and sequence parallel modules from sharding plans (DModule).

    from torch.distributed.tensor import Replicate, Shard
    from ndweave.dmodule import deferred_init, parallelize_module

    mlp = deferred_init(MLP)
    dmlp = parallelize_module(mlp, tp_mesh, param_sharding_plan={...}, fwd_resharding_plan={...})
    dmlp(x).sum().backward()
    dmlp.finish_grad_sync()

See README.md for plans, patches, deferred init and debugging.
"""

from ndweave.mesh.agree import RankMismatchError
from ndweave.dmodule.api import parallelize_module
from ndweave.dmodule.deferred_init import MaterializeStats, deferred_init, is_deferred
from ndweave.dmodule.dmodule import DModule, GradSyncEntry
from ndweave.dmodule.factory import FactoryMode
from ndweave.dmodule.hooks import log_redistributions
from ndweave.dmodule.linear import dtensor_linears
from ndweave.dmodule.patches import register_patch
from ndweave.dmodule.plans import explain_plan, get_plan, list_plans, load_plan, save_plan
from ndweave.dmodule.spec import PlacementSpec, PlanKeyError

__version__ = "0.16.0"

__all__ = [
    "DModule",
    "FactoryMode",
    "GradSyncEntry",
    "MaterializeStats",
    "PlacementSpec",
    "PlanKeyError",
    "RankMismatchError",
    "deferred_init",
    "dtensor_linears",
    "explain_plan",
    "get_plan",
    "is_deferred",
    "list_plans",
    "load_plan",
    "log_redistributions",
    "parallelize_module",
    "register_patch",
    "save_plan",
    "__version__",
]
