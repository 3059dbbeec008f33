"""Forward resharding: hooks that lay out a module's inputs, outputs and weights per the plan.

Inputs arriving as plain tensors are taken to be already laid out per the plan (``from_local``);
DTensor inputs are redistributed. Outputs are redistributed, and handed back as local tensors when
the spec says ``to_local``. A weight named in the forward plan is redistributed before ``forward``
and the result shadows the parameter (an instance attribute) until ``forward`` returns, so autograd
carries its gradient back to the parameter's own layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ndweave.dmodule.plan import PlacementSpec
from ndweave.mesh.torch_compat import tree_map

__all__ = ["install_forward_hooks", "install_local_output_hook", "local_outputs", "log_redistributions"]

logger = logging.getLogger("ndweave.dmodule")

# Where log_redistributions() collects records; None when logging is off (the hot path checks this).
_LOG: list[str] | None = None


@contextlib.contextmanager
def log_redistributions() -> Iterator[list[str]]:
    """Log every redistribution a DModule's plan performs, while the block runs.

    Each line (``"fc2.output[0]: (Partial(sum),) -> (Replicate(),) shape (8, 4)"``) goes to the
    ``ndweave.dmodule`` logger at INFO and into the list this yields::

        with log_redistributions() as lines:
            dmlp(x)
        print("\\n".join(lines))
    """
    global _LOG
    previous, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = previous


def _log(where: str, src: Any, dst: tuple, shape: torch.Size, how: str = "") -> None:
    line = f"{where}: {tuple(src)} -> {tuple(dst)} shape {tuple(shape)}{how}"
    _LOG.append(line)
    logger.info(line)


def _layout(x: Any, mesh: DeviceMesh, spec: PlacementSpec | None, where: str) -> Any:
    """An input laid out per ``spec``: plain tensors are local pieces, DTensors get redistributed."""
    if spec is None or not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):
        if tuple(x.placements) == spec.placements and x.device_mesh == mesh:
            return x
        if _LOG is not None:
            _log(where, x.placements, spec.placements, x.shape)
        return x.redistribute(mesh, spec.placements, async_op=spec.async_op)
    if _LOG is not None:
        _log(where, ("local",), spec.placements, x.shape, " (from_local)")
    return DTensor.from_local(x, mesh, spec.placements, run_check=False)


def _finish_output(x: Any, mesh: DeviceMesh, spec: PlacementSpec | None, where: str) -> Any:
    if spec is None or not isinstance(x, torch.Tensor):
        return x
    x = _layout(x, mesh, spec, where)
    if spec.to_local:
        return x.to_local(grad_placements=spec.grad_placements)
    return x


class _ForwardPlan:
    """The forward plan of one module, applied by its pre- and post-forward hooks."""

    def __init__(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        self.fqn = fqn
        self.mesh = mesh
        self.inputs: list[PlacementSpec | None] | dict[str, PlacementSpec | None] | None = None
        self.outputs: list[PlacementSpec | None] | None = None
        self.weights: dict[str, PlacementSpec] = {}
        self.arg_names: list[str] = []
        self.module = module

    def bind_names(self) -> None:
        if isinstance(self.inputs, dict):
            sig = inspect.signature(self.module.forward)
            self.arg_names = [n for n, p in sig.parameters.items()
                              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            unknown = set(self.inputs) - set(sig.parameters)
            if unknown:
                raise ValueError(
                    f"forward plan {self.fqn or '<root>'}.input names {sorted(unknown)}, which "
                    f"{type(self.module).__name__}.forward{sig} does not take"
                )

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for name, spec in self.weights.items():
            param = module._parameters.get(name)
            if param is None:
                param = module._buffers[name]
            module.__dict__[name] = _layout(param, self.mesh, spec, f"{self.fqn}.{name}")
        if self.inputs is None:
            return args, kwargs
        if isinstance(self.inputs, dict):
            args = list(args)
            for name, spec in self.inputs.items():
                if name in kwargs:
                    kwargs[name] = _layout(kwargs[name], self.mesh, spec, f"{self.fqn}.input[{name}]")
                elif name in self.arg_names and self.arg_names.index(name) < len(args):
                    i = self.arg_names.index(name)
                    args[i] = _layout(args[i], self.mesh, spec, f"{self.fqn}.input[{name}]")
            return tuple(args), kwargs
        laid = [_layout(a, self.mesh, s, f"{self.fqn}.input[{i}]") for i, (a, s) in enumerate(zip(args, self.inputs))]
        return tuple(laid) + tuple(args[len(laid):]), kwargs

    def post_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        for name in self.weights:
            module.__dict__.pop(name, None)
        if self.outputs is None:
            return output
        if isinstance(output, torch.Tensor):
            return _finish_output(output, self.mesh, self.outputs[0], f"{self.fqn}.output[0]")
        if isinstance(output, (tuple, list)):
            done = [_finish_output(o, self.mesh, s, f"{self.fqn}.output[{i}]")
                    for i, (o, s) in enumerate(zip(output, self.outputs))]
            rest = list(output[len(done):])
            return type(output)(done + rest) if isinstance(output, list) else tuple(done + rest)
        raise TypeError(f"{self.fqn}.output plan given, but the module returned a {type(output).__name__}")


def install_forward_hooks(module: nn.Module, fqn: str, mesh: DeviceMesh, entries: dict[str, Any]) -> list:
    """Install the forward plan ``entries`` (leaf -> value) on ``module``; return the hook handles."""
    plan = _ForwardPlan(module, fqn, mesh)
    for leaf, value in entries.items():
        if leaf == "input":
            plan.inputs = value
        elif leaf == "output":
            plan.outputs = value
        else:
            plan.weights[leaf] = value
    plan.bind_names()
    handles = []
    if plan.inputs is not None or plan.weights:
        handles.append(module.register_forward_pre_hook(plan.pre_hook, with_kwargs=True))
    if plan.outputs is not None or plan.weights:
        handles.append(module.register_forward_hook(plan.post_hook))
    return handles


def local_outputs(output: Any) -> Any:
    """``output`` with every fully replicated DTensor in it replaced by its local tensor (the whole
    value, the same on every rank); sharded and ``Partial`` DTensors are left as they are.

    Walks tuples, lists, dicts and registered pytree nodes (HF ``ModelOutput``), and dataclasses.
    ``to_local()`` keeps autograd: the plain gradient that comes back is taken as ``Replicate``,
    which is what it is when every rank computes the same loss from the same value.
    """
    return tree_map(_local_leaf, output)


def _local_leaf(x: Any) -> Any:
    if isinstance(x, DTensor):
        return x.to_local() if all(p.is_replicate() for p in x.placements) else x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # a dataclass pytree does not know
        changes = {f.name: local_outputs(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        if any(v is not getattr(x, k) for k, v in changes.items()):
            return dataclasses.replace(x, **changes)
    return x


def install_local_output_hook(root: nn.Module) -> Any:
    """Hand the root's replicated DTensor outputs back as plain tensors (``use_local_output=True``).

    Registered after the root's own forward plan, so it sees the output that plan laid out; a loss
    computed outside the model then meets the user's plain target, as with torch's tensor parallel.
    """
    return root.register_forward_hook(lambda module, args, output: local_outputs(output))
