"""Loss scaling for fp16 training: the hook point both ndweave optimizers call.

Pass ``loss_scaler=`` to :class:`~ndweave.optim.DistributedOptimizer` or
:class:`~ndweave.optim.BasicOptimizer`; multiply the loss by ``loss_scaler.scale`` before
``backward()``. In ``step()`` the optimizer then, in this order:

1. divides the (sharded) grads by ``scale`` (unscale: before clipping, so ``clip_grad`` and the
   returned norm are in true units);
2. checks every rank's grads for inf/nan (one all-reduce);
3. on overflow skips the inner step and the parameter update entirely (``last_step_skipped``);
4. calls ``loss_scaler.update(found_inf)``.

Any object with a ``scale`` attribute and an ``update(found_inf: bool)`` method works;
:class:`DynamicLossScaler` is the usual grow/back-off policy::

    scaler = DynamicLossScaler()
    opt = DistributedOptimizer(torch.optim.AdamW, [model], loss_scaler=scaler)
    (loss * scaler.scale).backward()
    opt.step()
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["DynamicLossScaler", "unscale_and_check"]


class DynamicLossScaler:
    """Halve the scale on overflow; double it after ``growth_interval`` clean steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, min_scale: float = 1.0) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self._clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = float(state["scale"]), int(state["clean_steps"])


def unscale_and_check(grads: Iterable[torch.Tensor], scale: float, group: dist.ProcessGroup | None,
                      device: torch.device) -> bool:
    """Divide ``grads`` by ``scale`` in place; ``True`` if any rank of ``group`` saw inf or nan."""
    found = torch.zeros((), device=device)
    for g in grads:
        if scale != 1.0:
            g.mul_(1.0 / scale)
        found += (~torch.isfinite(g)).any().to(found.dtype)
    if dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())
