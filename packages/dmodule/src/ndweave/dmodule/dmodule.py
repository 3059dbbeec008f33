"""``DModule``: the mixin a parallelized module's class gains.

``parallelize_module`` swaps the module's class for a subclass of ``(DModule, original class)``
(what torch's FSDP2 ``fully_shard`` does), so methods live on a class, nothing is bound onto the
instance, and ``isinstance(m, DModule)`` and ``isinstance(m, OriginalClass)`` both hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ndweave.dmodule.factory import FactoryMode
from ndweave.dmodule.op_errors import explain_op_error
from ndweave.dmodule.plan import mesh_str
from ndweave.mesh.contracts import reduce_partial_grads

__all__ = ["DModule", "DModuleState", "GradSyncEntry"]


@dataclass(frozen=True)
class GradSyncEntry:
    """One gradient ``finish_grad_sync`` reduces (``pending``) or reduced last time (``synced``).
    Unpacks as veScale's ``(fqn, grad)`` pair: ``for fqn, grad in model.list_grad_sync()``."""

    fqn: str
    """The parameter's name."""
    placements: tuple
    """The gradient's placements when it was listed (``Partial`` on the dims to reduce)."""
    status: str
    """``"pending"`` or ``"synced"``."""
    grad: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """The parameter's gradient when it was listed."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.fqn, self.grad))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        return (self.fqn, self.grad)[index]


@dataclass
class DModuleState:
    """What ``parallelize_module`` leaves on the root module (``module._dmodule``)."""

    mesh: DeviceMesh
    factory_mode: FactoryMode | None = None
    """The ``FactoryMode`` the root's calls run under (``factory=``), or ``None``."""
    hook_handles: list = field(default_factory=list)
    last_synced: list[GradSyncEntry] = field(default_factory=list)
    called: bool = False
    """Whether the module ran once (its first call runs eagerly: see ``DModule.__call__``)."""


class DModule:
    """Mixin of every module ``parallelize_module`` returns. Do not instantiate it directly."""

    _dmodule: DModuleState

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if not self._dmodule.called:
                return self._first_call(*args, **kwargs)
            return super().__call__(*args, **kwargs)
        except RuntimeError as error:
            # torch raises these deep inside an op; name the module, what it expected and the fix
            clearer = explain_op_error(self, error)
            if clearer is None:
                raise
            raise clearer from error

    @torch.compiler.disable
    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        """The first call, eagerly, compiled submodules too (``torch.compile`` starts at the second):
        it agrees on plain inputs' shapes across ranks (a collective of Python objects), and auto plans
        find out whether the model needs plain tensors converted (``replicate_plain``), which most do
        not and then run without, so that the compiled blocks trace free of either."""
        with torch.compiler.set_stance("force_eager"):
            out = super().__call__(*args, **kwargs)
        self._dmodule.called = True
        return out

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh the module's parameters are distributed over."""
        return self._dmodule.mesh

    def finish_grad_sync(self) -> None:
        """All-reduce the ``Partial`` gradients backward left (bucketed; see ``reduce_partial_grads``),
        then bring every gradient to its parameter's placements.

        Partial grads come from sequence parallelism: a replicated norm weight fed a sequence-sharded
        activation gets a partial sum per rank. Implements ``ndweave.mesh.contracts.GradSyncable``.
        """
        # looked up each time, never cached: a wrapper applied later (FSDP2's fully_shard) replaces the
        # parameters, and a cached list would keep the old, unsharded ones alive
        params = list(self.named_parameters())
        partial = [(n, p) for n, p in params if _is_partial(p.grad)]
        if partial:
            self._dmodule.last_synced = [GradSyncEntry(n, tuple(p.grad.placements), "synced") for n, p in partial]
            reduce_partial_grads(p for _, p in partial)
        for _, p in params:
            g = p.grad
            if isinstance(g, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)

    def list_grad_sync(self) -> list[GradSyncEntry]:
        """Gradients ``finish_grad_sync`` will reduce now (status ``"pending"``), or, when none are
        pending, the ones it reduced last time (status ``"synced"``)."""
        params = dict(self.named_parameters())
        pending = [GradSyncEntry(n, tuple(p.grad.placements), "pending", p.grad)
                   for n, p in params.items() if _is_partial(p.grad)]
        if pending:
            return pending
        # the names only are kept between calls (holding the grads would keep them alive)
        return [GradSyncEntry(e.fqn, e.placements, e.status, getattr(params.get(e.fqn), "grad", None))
                for e in self._dmodule.last_synced]

    def dump_plan(self, *, print_out: bool = False) -> str:
        """A table of every parameter and buffer: FQN, placements, global and local shape, local bytes."""
        rows = [("fqn", "kind", "placements", "global shape", "local shape", "local bytes")]
        total = 0
        for kind, items in (("param", self.named_parameters()), ("buffer", self.named_buffers())):
            for fqn, t in items:
                if t is None:
                    continue
                local = t.to_local() if isinstance(t, DTensor) else t
                placements = ", ".join(map(repr, t.placements)) if isinstance(t, DTensor) else "(plain tensor)"
                nbytes = local.numel() * local.element_size()
                total += nbytes
                rows.append((fqn, kind, placements, str(tuple(t.shape)), str(tuple(local.shape)), str(nbytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"mesh {mesh_str(self.device_mesh)}; local total {total} bytes")
        out = "\n".join(lines)
        if print_out:
            print(out)
        return out


def _is_partial(g: torch.Tensor | None) -> bool:
    return isinstance(g, DTensor) and any(p.is_partial() for p in g.placements)


class FactoryDModule(DModule):
    """A DModule built with ``factory=``: its calls run under its ``FactoryMode``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._dmodule.factory_mode:
            return super().__call__(*args, **kwargs)


_CLASSES: dict[tuple[type, bool], type] = {}


def make_dmodule(module: nn.Module, state: DModuleState) -> nn.Module:
    """Swap ``module``'s class for its DModule subclass and attach ``state``."""
    cls = type(module)
    if issubclass(cls, DModule):  # parallelized before: start from the user's class again
        cls = next(c for c in cls.__mro__ if not issubclass(c, DModule))
    factory = state.factory_mode is not None
    dcls = _CLASSES.get((cls, factory))
    if dcls is None:
        mixin = FactoryDModule if factory else DModule
        dcls = type(f"DModule{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
        _CLASSES[(cls, factory)] = dcls
    module.__class__ = dcls
    module._dmodule = state
    return module


