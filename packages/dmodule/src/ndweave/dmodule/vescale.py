"""veScale's DModule entry point: a veScale script runs with only its imports changed.

    # from vescale.dmodule.api import parallelize_module
    # from vescale.initialize.deferred_init import deferred_init
    from ndweave.dmodule.vescale import deferred_init, parallelize_module

    dmlp = parallelize_module(mlp, mesh, sharding_plan)
    out = dmlp(x)                  # a DTensor, as veScale returns it
    out.to_local()

Two things differ from ``ndweave.dmodule.parallelize_module``, both veScale's: the root's outputs
stay DTensors (``use_local_output=False``), where ndweave, as torch's tensor parallel, hands
replicated outputs back as plain tensors; and input plan entries the forward cannot take are dropped
with a warning, where ndweave refuses them. Everything else is ndweave's ``parallelize_module`` (see
the package README's "Coming from veScale" for the deliberate differences).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ndweave.dmodule.api import parallelize_module as _parallelize_module
from ndweave.dmodule.deferred_init import deferred_init, is_deferred
from ndweave.dmodule.dmodule import DModule
from ndweave.dmodule.factory import FactoryArg
from ndweave.dmodule.signature import loose_input_plans
from ndweave.mesh import ParallelMesh

__all__ = ["deferred_init", "is_deferred", "is_dmodule", "parallelize_module"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | ParallelMesh | None = None,
    sharding_plan: Mapping[str, Mapping] | None = None,
    *,
    is_model_sharded: bool = False,
    factory: FactoryArg = False,
    grad_sync: bool | Mapping = True,
    use_local_output: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """veScale's ``parallelize_module``: ndweave's, with veScale's defaults.

    - Outputs stay as the plan leaves them (``use_local_output=False``): a ``Replicate`` output is a
      DTensor, so ``out.to_local()`` and ``out.redistribute(...)`` work as in veScale.
    - ``device_mesh=None``: the default mesh's ``"TP"`` dim (``ndweave.mesh.DEVICE_MESH``).
    - ``grad_sync``: ``True`` (veScale's default) or veScale's ``{ModuleClass: [param names]}``:
      ``finish_grad_sync()`` reduces every ``Partial`` gradient either way (what a selection that
      names every parameter with a ``Partial`` gradient does). ``False`` is refused: ndweave has no
      switch that leaves ``Partial`` gradients unreduced.
    - An input plan entry the forward does not take (a name it has no argument for, more entries than
      it has positional arguments) is dropped with a ``UserWarning``, as veScale drops it; ndweave's
      own ``parallelize_module`` refuses it (``PlanKeyError``).
    - Other keywords (``param_sharding_plan=``, ``fwd_resharding_plan=``, ``patches=``) are ndweave's.

    Example (the seed's MLP, as veScale writes it)::

        dmlp = parallelize_module(deferred_init(MLP), DeviceMesh("cuda", [0, 1, 2, 3]),
                                  param_sharding_plan={...}, fwd_resharding_plan={...})
        output = dmlp(input)          # a Replicate DTensor: output.to_local() is the whole value
        output.sum().backward()
        dmlp.finish_grad_sync()
    """
    if grad_sync is False or not isinstance(grad_sync, (bool, Mapping)):
        raise ValueError(
            f"parallelize_module: grad_sync={grad_sync!r} is not supported: finish_grad_sync() reduces every "
            "Partial gradient, as veScale's grad_sync=True does; drop the argument"
        )
    with loose_input_plans():
        return _parallelize_module(module, device_mesh, sharding_plan, is_model_sharded=is_model_sharded,
                                   factory=factory, use_local_output=use_local_output, **kwargs)


def is_dmodule(module: Any) -> bool:
    """Whether ``module`` was parallelized (veScale's ``is_dmodule``; ndweave: ``isinstance(m, DModule)``)."""
    return isinstance(module, DModule)
