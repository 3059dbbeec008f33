"""``factory=True``: tensors a forward creates (``torch.zeros``, ``arange``, ...) meet DTensors as
replicated DTensors instead of raising "mixed torch.Tensor and DTensor".

A ``TorchFunctionMode`` active during the DModule's forward tags every tensor a factory function
creates, and everything computed from tagged tensors alone (``torch.ones(t, t).tril()`` stays tagged).
When an op mixes DTensors with tagged tensors, the tagged ones become ``Replicate`` DTensors on the
mesh of the op's first DTensor (the module's mesh, or the submesh its tensors live on). Untagged
plain tensors are left alone: they are the user's, and mixing them is still an error worth seeing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from ndweave.mesh.torch_compat import tree_flatten, tree_map

__all__ = ["FactoryMode", "FACTORY_FUNCTIONS"]

#: Functions whose results are tagged as "created inside forward".
FACTORY_FUNCTIONS = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range, torch.linspace,
    torch.logspace, torch.eye, torch.tensor, torch.as_tensor, torch.randn, torch.rand, torch.randint,
    torch.randperm, torch.tril_indices, torch.triu_indices, torch.scalar_tensor,
})

_TAG = "_ndweave_factory"


def _tagged(x: Any) -> bool:
    return type(x) is torch.Tensor and getattr(x, _TAG, False)


class FactoryMode(TorchFunctionMode):
    """Active during a ``factory=True`` DModule's forward; see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORY_FUNCTIONS:
            out = func(*args, **kwargs)
            if type(out) is torch.Tensor:
                setattr(out, _TAG, True)
            return out
        flat, _ = tree_flatten((args, kwargs))
        dtensors = [x for x in flat if isinstance(x, DTensor)]
        has_tagged = any(_tagged(x) for x in flat)
        if not has_tagged:
            return func(*args, **kwargs)
        if dtensors:
            mesh = dtensors[0].device_mesh
            replicate = [Replicate()] * mesh.ndim

            def lift(x: Any) -> Any:
                return DTensor.from_local(x, mesh, replicate, run_check=False) if _tagged(x) else x

            args, kwargs = tree_map(lift, (args, kwargs))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        # computed from created tensors (and nothing distributed): still "created inside forward"
        for o in tree_flatten(out)[0]:
            if type(o) is torch.Tensor and o is not None:
                setattr(o, _TAG, True)
        return out
