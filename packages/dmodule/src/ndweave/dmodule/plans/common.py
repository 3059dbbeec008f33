"""Small helpers the zoo's plan modules share: placement shorthands and config checks."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard

__all__ = ["local", "seq_or_replicate", "config_of", "require"]


def local(placements: list) -> Any:
    """A forward placement that redistributes to ``placements`` and then hands on the plain local
    tensor (``PlacementSpec(..., to_local=True)``): how the zoo keeps attention on local heads."""
    from ndweave.dmodule import PlacementSpec  # the core; imported late so plans/ loads on its own

    return PlacementSpec(placements, to_local=True)


def seq_or_replicate(sequence_parallel: bool) -> list:
    """Layout of the residual stream: ``Shard(1)`` (sequence dim of (batch, seq, hidden)) under
    sequence parallelism, else ``Replicate()``."""
    return [Shard(1)] if sequence_parallel else [Replicate()]


def config_of(model: Any, plan_name: str) -> Any:
    """``model.config``, or a clear error naming the plan when the model has none."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f'plan "{plan_name}": {type(model).__name__} has no .config to read the shapes from')
    return config


def require(condition: bool, plan_name: str, message: str) -> None:
    if not condition:
        raise ValueError(f'plan "{plan_name}": {message}')
