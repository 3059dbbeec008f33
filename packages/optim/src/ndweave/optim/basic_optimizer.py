"""``BasicOptimizer``: an unsharded torch optimizer that finishes every pending grad sync first, so
``zero_grad(); loss.backward(); step()`` is the whole training loop for any composition (DDP
buckets in flight, sequence-parallel ``Partial`` grads, plain models)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.mesh.contracts import (DataParallelWrapper, finish_grad_sync, finish_grad_sync_for_step, is_tied_replica,
                                    uses_distributed_optimizer)
from ndweave.mesh.torch_compat import local_tensor
from ndweave.optim.base import WrappedOptimizer
from ndweave.optim.grad_norm import counts_replica, whole_on_every_rank
from ndweave.optim.inner import resolve_optimizer

__all__ = ["BasicOptimizer"]


class BasicOptimizer(WrappedOptimizer):
    """A torch optimizer over the models' own params (DTensor or plain), with grad sync, global
    clipping and loss scaling handled.

    Args:
        optimizer: a torch optimizer class (built over the models' trainable params with
            ``optimizer_kwargs``) or an instance built over them (used as is).
        models: the models (DDP-wrapped with ``use_distributed_optimizer=False``, DModules, plain).
        clip_grad: clip to this global grad norm in every ``step()`` (0: no clipping).
        loss_scaler: fp16 loss scaling (see :mod:`ndweave.optim.loss_scale`).
        grad_norm_group: group the grad norm is summed over (default: the whole world).
        on_nonfinite: ``"raise"`` (default), ``"skip"`` or ``"unchecked"``: what ``step()`` does on an
            inf/nan global grad norm, on every rank alike (:data:`ndweave.optim.base.ON_NONFINITE`).

    ``state_dict()`` is the inner torch optimizer's (DTensor state where the params are DTensors).

    Example::

        opt = BasicOptimizer(torch.optim.AdamW, [model], optimizer_kwargs={"lr": 1e-3})
        opt.zero_grad(); model(x).sum().backward(); opt.step()
    """

    def __init__(
        self,
        optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer,
        models: Sequence[torch.nn.Module] | torch.nn.Module,
        *,
        clip_grad: float = 0.0,
        optimizer_kwargs: dict[str, Any] | None = None,
        loss_scaler: Any = None,
        grad_norm_group: dist.ProcessGroup | None = None,
        on_nonfinite: Literal["raise", "skip", "unchecked"] = "raise",
    ) -> None:
        models = [models] if isinstance(models, torch.nn.Module) else list(models)
        # DP rank of each bucketed param: replicated over DP, so only DP rank 0 counts it in the norm
        self._dp_rank: dict[int, int] = {}
        for model in models:
            if isinstance(model, DataParallelWrapper):
                if uses_distributed_optimizer(model):
                    raise ValueError(
                        f"{type(model).__name__} was built with use_distributed_optimizer=True (its buckets carry "
                        "param_data): its grads are only reduced on this rank's shard of each bucket. Use "
                        "DistributedOptimizer, or build it with use_distributed_optimizer=False for BasicOptimizer"
                    )
                for bucket in model.grad_buckets():
                    for bp in bucket.params:
                        self._dp_rank[id(bp.param)] = bucket.data_parallel_rank
        if isinstance(optimizer, torch.optim.Optimizer):
            if optimizer_kwargs:
                raise ValueError("optimizer_kwargs applies to an optimizer class; an instance already has its hyperparameters")
            inner = optimizer
        else:
            spec = resolve_optimizer(optimizer, optimizer_kwargs)
            params, seen = [], set()
            for model in models:
                for p in model.parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            inner = spec.build([params])
        self._init_wrapper(inner, models, clip_grad=clip_grad, loss_scaler=loss_scaler, grad_norm_group=grad_norm_group,
                           on_nonfinite=on_nonfinite)
        self._counted: dict[tuple, bool] = {}
        wrapped = all(isinstance(m, DataParallelWrapper) for m in models)
        self._whole = wrapped and whole_on_every_rank([b for m in models for b in m.grad_buckets()], grad_norm_group) \
            and all(id(p) in self._dp_rank and not is_tied_replica(p) for p in self._params())

    def _params(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        out = []
        for group in self.inner.param_groups:
            for p in group["params"]:
                if id(p) not in seen:  # tied params: one object, counted once
                    seen.add(id(p))
                    out.append(p)
        return out

    def _sync_grads(self) -> None:
        if self.loss_scaler is None and self._whole:
            # no collective in the step (the norm is taken from the whole grads): the wrappers' check
            # before it has nothing to guard, so none is gathered (a skipped or an extra step shows in
            # the counters the next grad sync compares)
            finish_grad_sync_for_step(self.models)
        else:
            finish_grad_sync(self.models)

    def _whole_grads(self) -> list[torch.Tensor] | None:
        return self._local_grads() if self._whole else None

    def _owned_grads(self) -> list[torch.Tensor]:
        return [
            local_tensor(p.grad) for p in self._params()
            if p.grad is not None and self._dp_rank.get(id(p), 0) == 0 and self._counts(p.grad)
            and not is_tied_replica(p)
        ]

    def _counts(self, grad: torch.Tensor) -> bool:
        """``counts_replica`` for a grad, memoized per (mesh, placements): asked for every grad each step."""
        if not isinstance(grad, DTensor):
            return True
        key = (grad.device_mesh, tuple(grad.placements))
        if key not in self._counted:
            self._counted[key] = counts_replica(grad)
        return self._counted[key]

    def _local_grads(self) -> list[torch.Tensor]:
        return [local_tensor(p.grad) for p in self._params() if p.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the params' grads and, for DDP-wrapped models, their grad buffers. With
        ``set_to_none=False`` every grad stays a (zeroed) tensor, as in torch."""
        kept = [] if set_to_none else [(p, p.grad) for p in self._params() if p.grad is not None]
        for model in self.models:
            if isinstance(model, DataParallelWrapper):
                model.zero_grad_buffer()
        for p, grad in kept:
            if p.grad is None:  # the wrapper dropped the grad it published (a view of its zeroed buffer)
                p.grad = grad
        self.inner.zero_grad(set_to_none=set_to_none)
        self._grads_ready = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)
        # a param no bucket syncs has a grad of this rank's own: the norm sums the ranks' again
        self._whole = self._whole and all(id(p) in self._dp_rank and not is_tied_replica(p) for p in self._params())

    def _state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
