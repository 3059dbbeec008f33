"""Resolving the ``optimizer`` argument (a torch optimizer class or instance) into what to build.

Both ndweave optimizers wrap an *inner* torch optimizer: the user's class, built over the tensors
ndweave decides (the fp32 shards for :class:`~ndweave.optim.DistributedOptimizer`, the params for
:class:`~ndweave.optim.BasicOptimizer`) with the user's hyperparameters, group by group.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ELEMENTWISE_OPTIMIZERS", "FUSED_OPTIMIZERS", "NON_ELEMENTWISE_OPTIMIZERS", "InnerSpec", "check_elementwise",
           "resolve_optimizer"]

#: torch optimizers whose update of an element depends only on that element's grad and state (and
#: per-step scalars), so stepping any flat range of a parameter equals stepping the whole of it.
ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)

#: torch optimizers known to look at whole parameters (factored moments, orthogonalization, line
#: search, sparse grads): they cannot step flat ranges.
NON_ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    getattr(torch.optim, name) for name in ("LBFGS", "Adafactor", "Muon", "SparseAdam") if hasattr(torch.optim, name)
)

#: torch optimizers with a fused kernel on CPU and CUDA: one call steps every tensor of a group in
#: one pass over memory (the unfused CPU path makes ~10 passes, one per elementwise op).
FUSED_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    getattr(torch.optim, name) for name in ("Adam", "AdamW", "SGD") if hasattr(torch.optim, name)
)


@dataclass
class InnerSpec:
    """How to build the inner optimizer: its class, constructor kwargs and one dict per group."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    groups: list[dict[str, Any]]
    """Hyperparameters of each param group (no ``"params"`` key)."""
    group_of: dict[int, int] = field(default_factory=dict)
    """``id(param) -> group index`` for an instance's params; empty for a class (one group, all params)."""

    def group_index(self, param: torch.Tensor) -> int | None:
        """The group ``param`` belongs to; ``None`` if the user's optimizer does not hold it."""
        return self.group_of.get(id(param)) if self.group_of else 0

    def fused(self, dtype: torch.dtype, device: torch.device | str) -> list[int]:
        """Turn on torch's fused kernel (``fused=True``) in every group that left the implementation to
        torch (``fused`` and ``foreach`` unset), where one exists for ``dtype`` masters on ``device``:
        fp32 or float64 on CPU or CUDA (fused bf16/fp16 steps compute in fp32, unlike the unfused ones).
        Returns the indices of the groups changed."""
        if (self.cls not in FUSED_OPTIMIZERS or dtype not in (torch.float32, torch.float64)
                or torch.device(device).type not in ("cpu", "cuda")):
            return []
        changed = []
        for index, group in enumerate(self.groups):
            options = {**self.kwargs, **group}
            if options.get("fused") is None and options.get("foreach") is None and not options.get("differentiable"):
                self.groups[index] = {**group, "fused": True}
                changed.append(index)
        return changed

    def build(self, groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        """The inner optimizer over ``groups[i]`` with group ``i``'s hyperparameters."""
        return self.cls([{**hyper, "params": params} for hyper, params in zip(self.groups, groups)], **self.kwargs)

    def probe_state(self, group: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, Any]:
        """The state one step of this optimizer creates for a parameter of group ``group`` (``dtype``, on
        ``device``): found by stepping a throwaway over a two-element tensor (zero grad), so it needs no
        communication and no stepped optimizer. Tensors of shape ``(2,)`` are the elementwise ones."""
        probe = torch.nn.Parameter(torch.zeros(2, dtype=dtype, device=device))
        throwaway = self.cls([{**self.groups[group], "params": [probe]}], **self.kwargs)
        probe.grad = torch.zeros_like(probe)
        throwaway.step()
        return dict(throwaway.state[probe])


def resolve_optimizer(
    optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer, optimizer_kwargs: dict[str, Any] | None
) -> InnerSpec:
    """Turn a class (plus ``optimizer_kwargs``) or an instance into an :class:`InnerSpec`.

    An instance is re-created over new tensors: its ``param_groups`` hyperparameters (``lr``,
    ``weight_decay``, an lr scheduler's ``initial_lr``...) are kept per group; its state is not.
    """
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        kwargs = dict(optimizer_kwargs or {})
        return InnerSpec(cls=optimizer, kwargs=kwargs, groups=[{}])
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer_kwargs:
            raise ValueError("optimizer_kwargs applies to an optimizer class; an instance already has its hyperparameters")
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups, group_of = [], {}
        for index, group in enumerate(optimizer.param_groups):
            groups.append({k: v for k, v in group.items() if k != "params"})
            for p in group["params"]:
                group_of[id(p)] = index
        return InnerSpec(cls=cls, kwargs=kwargs, groups=groups, group_of=group_of)
    raise TypeError(f"optimizer must be a torch.optim.Optimizer class or instance, got {optimizer!r}")


def check_elementwise(cls: type[torch.optim.Optimizer], assume_elementwise: bool) -> None:
    """Refuse optimizers that cannot step flat ranges of parameters."""
    if cls in ELEMENTWISE_OPTIMIZERS:
        return
    if cls in NON_ELEMENTWISE_OPTIMIZERS:
        raise ValueError(
            f"{cls.__name__} is not elementwise (it needs whole parameters), so DistributedOptimizer cannot "
            "step it on flat shards that cut parameters anywhere; use ndweave.optim.BasicOptimizer "
            "(no optimizer-state sharding) instead"
        )
    if not assume_elementwise:
        raise ValueError(
            f"{cls.__name__} is not in ndweave.optim.ELEMENTWISE_OPTIMIZERS; DistributedOptimizer steps flat "
            "shards that cut parameters anywhere, which is only correct for elementwise optimizers. If "
            f"{cls.__name__} is elementwise pass assume_elementwise=True, else use BasicOptimizer"
        )
