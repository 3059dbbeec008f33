"""Forward resharding: hooks that lay out a module's inputs, outputs and weights per the plan.

Input plans reach their arguments through slots bound to the forward signature (``signature.py``).
Plan values nest like the values they lay out: a list by position (tuple, list), a dict by name
(dict, dataclass, HF ``ModelOutput``).
Inputs arriving as plain tensors are taken to be already laid out per the plan (``from_local``);
DTensor inputs are redistributed. Outputs are redistributed, and handed back as local tensors when
the spec says ``to_local``. A weight named in the forward plan is redistributed before ``forward``
and the result shadows the parameter (an instance attribute) until ``forward`` returns, so autograd
carries its gradient back to the parameter's own layout.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ndweave.dmodule.relayout import from_local, redistribute, to_local
from ndweave.dmodule.spec import PlacementSpec, PlanKeyError, suggest
from ndweave.dmodule.signature import InputSlot, apply_input_slots, bind_input_plan
from ndweave.mesh.agree import agree_or_raise
from ndweave.mesh.torch_compat import own_buffers, own_parameters, tree_map

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


#: Where a value sits in the plan (``"transformer.h.0.attn.input[0]"``), formatted only when a message
#: or the log needs it: a string read in a compiled forward would be guarded per module (each block's
#: FQN differs), so every block would compile again.
Where = Callable[[], str]


def _log(where: Where, src: Any, dst: tuple, shape: torch.Size, how: str = "") -> None:
    line = f"{where()}: {tuple(src)} -> {tuple(dst)} shape {tuple(shape)}{how}"
    _LOG.append(line)
    logger.info(line)


def _layout(x: Any, mesh: DeviceMesh, spec: PlacementSpec | None, where: Where) -> Any:
    """An input laid out per ``spec``: plain tensors are local pieces, DTensors get redistributed."""
    if spec is None or not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):
        # placements alone: a DTensor of another mesh cannot be redistributed here anyway, and comparing
        # the mesh objects would be guarded per module under torch.compile (a block's input mesh may be an
        # equal, other object than its hooks'), so each block would compile again
        if tuple(x.placements) == spec.placements or _same_layout(x, spec.placements):
            return x
        if _LOG is not None:
            _log(where, x.placements, spec.placements, x.shape)
        return redistribute(x, mesh, spec.placements, async_op=spec.async_op)
    if _LOG is not None:
        _log(where, ("local",), spec.placements, x.shape, " (from_local)")
    return from_local(x, mesh, spec.placements)


def _same_layout(x: DTensor, placements: tuple) -> bool:
    """Whether ``placements`` is ``x``'s layout with a dim counted from the end (``Shard(-1)``, as
    plans write a linear's features): no redistribution, no autograd node, no line in the log."""
    return len(placements) == len(x.placements) and all(
        p == q or type(p) is Shard and type(q) is Shard and p.dim % x.ndim == q.dim % x.ndim
        for p, q in zip(placements, x.placements))


def _finish_output(x: Any, mesh: DeviceMesh, spec: PlacementSpec | None, where: Where) -> Any:
    if spec is None or not isinstance(x, torch.Tensor):
        return x
    x = _layout(x, mesh, spec, where)
    if spec.to_local:
        return to_local(x, spec.grad_placements)
    return x


def _lay_tree(x: Any, tree: Any, where: Where, lay: Callable[[Any, PlacementSpec, Where], Any]) -> Any:
    """``x`` with ``lay`` applied at every spec of the plan value ``tree``, following its nesting:
    a list by position (tuple/list), a dict by name (dict, dataclass, HF ``ModelOutput``)."""
    if tree is None or x is None:
        return x
    if isinstance(tree, PlacementSpec):
        return lay(x, tree, where)
    if isinstance(tree, list):
        if not isinstance(x, (tuple, list)):
            raise TypeError(f"{where()}: the plan lists {len(tree)} entries by position, but got a {type(x).__name__}; "
                            "plan a dict, dataclass or ModelOutput by name ({'field': [...]})")
        if len(tree) > len(x):
            raise ValueError(f"{where()}: the plan lists {len(tree)} entries, but got {len(x)}; drop the extra entries")
        done = [_lay_tree(v, t, _at(where, i), lay) for i, (v, t) in enumerate(zip(x, tree))]
        done += x[len(done):]
        return type(x)(*done) if hasattr(x, "_fields") else type(x)(done)  # a namedtuple takes fields
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # HF ModelOutput too: by field name
        fields = [f.name for f in dataclasses.fields(x)]
        _check_names(tree, fields, where, type(x).__name__)
        changes = {k: _lay_tree(getattr(x, k), t, _at(where, k), lay) for k, t in tree.items()}
        return dataclasses.replace(x, **changes)
    if isinstance(x, Mapping):
        _check_names(tree, list(x), where, type(x).__name__)
        out = copy.copy(x)
        out.update({k: _lay_tree(x[k], t, _at(where, k), lay) for k, t in tree.items()})
        return out
    raise TypeError(f"{where()}: the plan names {sorted(tree)}, but got a {type(x).__name__}; "
                    "plan a tensor, tuple or list by position ([[...], ...])")


def _at(where: Where, key: Any) -> Where:
    return lambda: f"{where()}[{key}]"


def _check_names(tree: dict, names: list[str], where: Where, what: str) -> None:
    for k in tree:
        if k not in names:
            raise PlanKeyError(f"{where()}: the plan names {k!r}, which this {what} does not have"
                               f"{suggest(str(k), names)} (it has {names})")


class _ForwardPlan:
    """The forward plan of one module, applied by its pre- and post-forward hooks."""

    def __init__(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        self.fqn = fqn
        self.mesh = mesh
        self.inputs: list[InputSlot] | None = None
        self.outputs: list | dict | None = None
        self.weights: dict[str, PlacementSpec] = {}
        self.plain_inputs: dict[str, tuple] | None = {}
        """Shapes of the plain inputs of the first call, checked across ranks; ``None`` once checked."""

    def _input(self, x: Any, spec: PlacementSpec, where: Where) -> Any:
        if self.plain_inputs is not None and isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            self.plain_inputs[where()] = (tuple(x.shape), str(x.dtype))
        return _layout(x, self.mesh, spec, where)

    @torch.compiler.disable  # (a collective of Python objects, once: outside any compiled graph)
    def _check_plain_inputs(self) -> None:
        """On the first call only: every rank's plain inputs have one shape and dtype. ``from_local``
        trusts them without communication; a rank-dependent shape (a batch size read per rank) would
        give ranks different global shapes and hang their next collective. Every call would cost a
        collective and a host sync per forward: later calls are left to the process-group timeout."""
        seen, self.plain_inputs = self.plain_inputs, None
        if seen:
            agree_or_raise(
                self.mesh, f"forward of {self.fqn or '<root>'!r}", lambda: (None, {"input shape": seen}),
                hint="a plain input under an input plan is this rank's piece of one tensor, the same shape "
                     "on every rank of the mesh (Replicate: the whole value; Shard: an even piece); pass "
                     "equal shapes (e.g. the same batch size on every rank) or a DTensor")

    def _output(self, x: Any, spec: PlacementSpec, where: Where) -> Any:
        return _finish_output(x, self.mesh, spec, where)

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for name, spec in self.weights.items():
            param = own_parameters(module).get(name)
            if param is None:
                param = own_buffers(module)[name]
            module.__dict__[name] = _layout(param, self.mesh, spec, lambda name=name: f"{self.fqn}.{name}")
        if self.inputs is None:
            return args, kwargs
        laid = apply_input_slots(self.inputs, args, kwargs,
                                 lambda x, tree, label: _lay_tree(x, tree, lambda: f"{self.fqn}.input[{label}]",
                                                                  self._input))
        if self.plain_inputs is not None:
            self._check_plain_inputs()
        return laid

    def post_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        for name in self.weights:
            module.__dict__.pop(name, None)
        if self.outputs is None:
            return output
        def where() -> str:
            return f"{self.fqn}.output"

        if isinstance(output, torch.Tensor) and isinstance(self.outputs, list):
            return _lay_tree(output, self.outputs[0], _at(where, 0), self._output)
        if output is None or isinstance(output, torch.Tensor):
            raise TypeError(f"{where()} plan names fields {sorted(self.outputs)}, but the module returned a "
                            f"{type(output).__name__}; plan it by position: [[...]]")
        return _lay_tree(output, self.outputs, where, self._output)


def install_forward_hooks(module: nn.Module, fqn: str, mesh: DeviceMesh, entries: dict[str, Any]) -> list:
    """Install the forward plan ``entries`` (leaf -> value) on ``module``; return the hook handles."""
    plan = _ForwardPlan(module, fqn, mesh)
    for leaf, value in entries.items():
        if leaf == "input":
            plan.inputs = bind_input_plan(module, fqn, value)
        elif leaf == "output":
            plan.outputs = value
        else:
            plan.weights[leaf] = value
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
