"""Deferred staging of an asynchronous save: which tensors may be copied after ``save`` returns, and
the optimizer step pre-hook that waits for that copy.

Parameters and optimizer state change only in an optimizer's ``step()`` (and ``load_state_dict``);
everything else a state may hold (module buffers such as BatchNorm's running stats, updated in
forward; plain tensors) can change at any time. So ``save(..., async_checkpoint=True)`` copies the
latter before it returns and leaves the former to the background thread, while every optimizer of
the state gets a step pre-hook (:class:`StagingGate`) that holds its next ``step()`` until that copy is
done. What counts as "the optimizer's" is decided by storage, not by name: a parameter of a DDP
wrapper is a view into its bucket's flat ``param_data``, a sharded optimizer's master weights may be
views of it too, and a ``DistributedOptimizer``'s all-gather after the step rewrites all of it; so
every storage any of these tensors lives in is the optimizer's, and a saved tensor in one of them is
left for later.

Hooks cannot be removed by the background thread: torch iterates an optimizer's pre-hook dict while
calling them, and a removal in the middle makes that iteration raise. A gate whose copy is done is a
no-op; it is removed in the calling thread by ``SaveHandle.wait_staged()`` / ``wait()``, or by the
next save of a state holding the same optimizer (:func:`remove_finished_gates`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ndweave.checkpoint.entries import as_list, entry_kind
from ndweave.checkpoint.errors import CheckpointError
from ndweave.mesh.contracts import StatePiece
from ndweave.mesh.torch_compat import local_tensor

__all__ = ["StagingGate", "optimizers_of", "remove_finished_gates", "step_storages", "storage_key"]


def optimizers_of(state: dict[str, Any]) -> list[torch.optim.Optimizer]:
    """Every optimizer of the ``state``'s optimizer entries."""
    return [o for v in state.values() if entry_kind(v) == "optimizers" for o in as_list(v)]


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """The storage ``tensor`` lives in (device, address); ``None`` for an empty one (nothing to copy,
    and every empty storage has the same address)."""
    if isinstance(tensor, DTensor):
        tensor = local_tensor(tensor)
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr()) if storage.nbytes() else None


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, StatePiece):
        yield value.data
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def step_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[tuple[torch.device, int]]:
    """The storages the optimizers' ``step()`` writes: their params, their state, and the params of
    the models an ndweave optimizer holds (``models``: a sharded optimizer all-gathers into them)."""
    keys = set()
    for optimizer in optimizers:
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += list(_tensors(list(optimizer.state.values())))
        tensors += [p for m in getattr(optimizer, "models", []) if isinstance(m, torch.nn.Module) for p in m.parameters()]
        keys.update(storage_key(t) for t in tensors)
    keys.discard(None)
    return keys


class StagingGate:
    """The step pre-hook of every optimizer of one asynchronous save: ``step()`` waits until the
    background thread has copied the parameters and optimizer state this rank writes. A copy that
    failed raises from the first hook that sees it (and from ``wait()``)."""

    def __init__(self, path: Path, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.path = path
        self._staged = threading.Event()
        self._error: BaseException | None = None
        self.reported = False
        """Whether a failed copy was raised to the caller (by a hook or ``wait()``)."""
        self._handles = [optimizer.register_step_pre_hook(self) for optimizer in optimizers]

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._staged.wait()
        if self._error is not None and not self.reported:
            self.reported = True  # once: a training loop that catches it may go on
            raise self._failure()

    def _failure(self) -> CheckpointError:
        error = CheckpointError(f"the asynchronous save of {self.path} failed before it finished copying the "
                                f"tensors it writes: {self._error!r}")
        error.__cause__ = self._error
        return error

    def finished(self) -> bool:
        return self._staged.is_set()

    def finish(self, error: BaseException | None = None) -> None:
        """Called by the background thread once the copy is done (or failed with ``error``); a later
        call changes nothing (a failure after the copy is ``wait()``'s to raise, not a step's)."""
        if not self._staged.is_set():
            self._error = error
            self._staged.set()

    def wait(self) -> None:
        """Block until the copy is done, remove the hooks, raise a failed copy's error."""
        self._staged.wait()
        self.remove()
        if self._error is not None:
            self.reported = True
            raise self._failure()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def hooked(self) -> int:
        """How many optimizers still hold this gate's hook."""
        return len(self._handles)


def _no_op(optimizer: Any, args: Any, kwargs: Any) -> None:
    return None


def remove_finished_gates(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Remove the hooks of earlier saves whose copy is done from ``optimizers`` (outside any step:
    the next save calls this). Their dict is reached through a handle of a probe hook: torch gives
    no other public way to list an optimizer's hooks."""
    for optimizer in optimizers:
        probe = optimizer.register_step_pre_hook(_no_op)
        hooks = probe.hooks_dict_ref()
        probe.remove()
        for hook in [] if hooks is None else list(hooks.values()):
            if isinstance(hook, StagingGate) and hook.finished():
                hook.remove()
