"""``factory=``: tensors a planned forward creates (``torch.zeros``, ``arange``, ...) come out as
DTensors, so they meet the module's DTensors without "mixed torch.Tensor and DTensor".

The forms (veScale's)::

    factory=True                                   # every supported function, Replicate, in the root's forward
    factory={Block: True}                          # only while a Block's forward runs
    factory={Block: True, Attention: False}        # ... but not inside Attention (the innermost class wins)
    factory={MLP: {torch.zeros: [Shard(0)]}}       # only these functions, with these placements

A created tensor is what the call makes on one device (``torch.zeros(x.shape)`` of a DTensor ``x``
is full size), laid out per the placements: ``Replicate`` keeps it whole, ``Shard`` keeps this rank's
piece, cut locally without communication (a random one is this rank's piece of its own full draw,
so equal seeds on every rank give what one process draws).

Only the model's own code is converted. torch's code calls the same functions under the mode
(DTensor's redistribute concatenates and pads with ``torch.cat`` / ``torch.zeros``), and so do
ndweave's patches, written for plain tensors; their tensors stay plain.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.overrides import TorchFunctionMode

from ndweave.dmodule.plan import names_removed_module, no_match_error
from ndweave.dmodule.spec import as_spec

__all__ = ["FACTORY_FUNCTIONS", "FactoryArg", "FactoryMode", "install_factory"]

#: The functions ``factory=`` converts.
FACTORY_FUNCTIONS = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.linspace, torch.eye,
    torch.rand, torch.randn, torch.randint,
})

#: What ``parallelize_module(factory=...)`` takes (see the module docstring).
FactoryArg = Union[bool, Mapping[type, Union[bool, Mapping[Callable, Any], None]], None]

FactoryPlan = dict[Callable, tuple[Placement, ...]]  # empty: off


class FactoryMode(TorchFunctionMode):
    """Active during a ``factory=`` DModule's forward; converts per the innermost planned class."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.active: list[FactoryPlan] = []  # one per planned module whose forward is running

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        plan = self.active[-1] if self.active else None
        if not plan or func not in plan or type(out) is not torch.Tensor or not _called_by_model(sys._getframe(1)):
            return out
        # src_data_rank=None: every rank cuts its piece of its own tensor, no communication
        return distribute_tensor(out, self.mesh, plan[func], src_data_rank=None)


def _called_by_model(frame: FrameType | None) -> bool:
    # another mode above this one (``with torch.device(...)`` inside forward) passes the call on from
    # its own __torch_function__: the creator is whoever called that
    while frame is not None and frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    name = "" if frame is None else frame.f_globals.get("__name__", "")
    return not (name == "torch" or name.startswith(("torch.", "ndweave.")))


class _FactoryScope:
    """The pre/post-forward hooks of one planned module: its plan is in force while its forward runs.
    (Bound methods, not closures: ``copy.deepcopy`` of the model then copies the mode with it.)"""

    def __init__(self, mode: FactoryMode, plan: FactoryPlan) -> None:
        self.mode = mode
        self.plan = plan

    def enter(self, module: nn.Module, args: Any) -> None:
        self.mode.active.append(self.plan)

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.mode.active.pop()


def install_factory(root: nn.Module, mesh: DeviceMesh, factory: FactoryArg) -> tuple[FactoryMode | None, list]:
    """The mode the root's calls run under and the hooks that scope it, or ``(None, [])`` when off."""
    plans = _normalize(factory, root, mesh)
    if not plans:
        return None, []
    mode = FactoryMode(mesh)
    handles = []
    for m in root.modules():
        if type(m) in plans:
            scope = _FactoryScope(mode, plans[type(m)])
            # first in, and popped even when forward raises: the stack stays balanced
            handles.append(m.register_forward_pre_hook(scope.enter, prepend=True))
            handles.append(m.register_forward_hook(scope.exit, always_call=True))
    return mode, handles


def _normalize(factory: FactoryArg, root: nn.Module, mesh: DeviceMesh) -> dict[type, FactoryPlan]:
    if factory is None or factory is False:
        return {}
    if factory is True:
        factory = {type(root): True}
    if not isinstance(factory, Mapping):
        raise TypeError(f"factory={factory!r}: give True/False or {{ModuleClass: True | False | "
                        f"{{torch.zeros: [placements], ...}}}}, e.g. {{{type(root).__name__}: True}}")
    present = {type(m) for m in root.modules()}
    plans = {}
    for cls, value in factory.items():
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"factory keys are module classes, e.g. {{{type(root).__name__}: True}}; got {cls!r}")
        key = f"class:{cls.__name__}"
        if cls not in present and not names_removed_module(root, key):
            raise no_match_error("factory", key, (f"class:{c.__name__}" for c in present))
        plans[cls] = _class_plan(cls, value, mesh)
    return plans


def _class_plan(cls: type, value: Any, mesh: DeviceMesh) -> FactoryPlan:
    replicate = (Replicate(),) * mesh.ndim
    if value is True:
        return dict.fromkeys(FACTORY_FUNCTIONS, replicate)
    if not value:  # False, None, {}: off inside this class
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"factory[{cls.__name__}]={value!r}: give True, False or {{torch.zeros: [placements], ...}}")
    plan = {}
    for func, placements in value.items():
        if func not in FACTORY_FUNCTIONS:
            names = sorted(f"torch.{f.__name__}" for f in FACTORY_FUNCTIONS)
            raise ValueError(f"factory[{cls.__name__}]: {func!r} is not a factory function ndweave converts; "
                             f"supported: {names}")
        spec = as_spec(placements, f"factory[{cls.__name__}][torch.{func.__name__}]")
        if spec is None:
            continue
        if len(spec.placements) != mesh.ndim or any(isinstance(p, Partial) for p in spec.placements):
            raise ValueError(f"factory[{cls.__name__}][torch.{func.__name__}]: {list(spec.placements)} on a "
                             f"{mesh.ndim}-D mesh; give one Shard or Replicate per mesh dim")
        plan[func] = spec.placements
    return plan
