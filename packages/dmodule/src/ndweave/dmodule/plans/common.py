"""Small helpers the zoo's plan modules share: placement shorthands, config checks, and the
warning of a deprecated patch name."""

from __future__ import annotations

import warnings
from typing import Any

from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule.spec import PlacementSpec

__all__ = ["local", "logits_output", "seq_or_replicate", "config_of", "require", "warn_deprecated_patch"]


def local(placements: list) -> PlacementSpec:
    """A forward placement that redistributes to ``placements`` and then hands on the plain local
    tensor (``PlacementSpec(..., to_local=True)``): how the zoo keeps attention on local heads."""
    return PlacementSpec(placements, to_local=True)


def seq_or_replicate(sequence_parallel: bool) -> list:
    """Layout of the residual stream: ``Shard(1)`` (sequence dim of (batch, seq, hidden)) under
    sequence parallelism, else ``Replicate()``."""
    return [Shard(1)] if sequence_parallel else [Replicate()]


def logits_output(loss_parallel: bool) -> list:
    """``lm_head``'s output plan. By default the logits are gathered and handed on as a plain tensor
    (every rank holds the full (batch, seq, vocab) logits; the model's own loss runs unchanged).
    With ``loss_parallel`` they stay ``Shard(-1)`` DTensors, each rank holding its vocabulary
    columns, for torch's ``loss_parallel()`` cross-entropy."""
    return [[Shard(-1)]] if loss_parallel else [local([Replicate()])]


def config_of(model: Any, plan_name: str) -> Any:
    """``model.config``, or a clear error naming the plan when the model has none."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f'plan "{plan_name}": {type(model).__name__} has no .config to read the shapes from')
    return config


def require(condition: bool, plan_name: str, message: str) -> None:
    if not condition:
        raise ValueError(f'plan "{plan_name}": {message}')


def warn_deprecated_patch(name: str, replacement: str) -> None:
    """Warn that a plan names the zoo's per-model patch ``name``, kept registered for one release so
    saved plans still load, and which generic patches replace it (``replacement``, as JSON)."""
    warnings.warn(f"patch {name!r} is deprecated and will be removed in the next release; the zoo's plans now "
                  f"use the generic patches {replacement}: name those in your plan (get_plan() emits them)",
                  DeprecationWarning, stacklevel=3)
