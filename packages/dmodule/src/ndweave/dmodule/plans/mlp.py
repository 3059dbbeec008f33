"""Plan "mlp": the two-layer MLP of the DModule README (``fc1`` -> ReLU -> ``fc2``).

Megatron-style: ``fc1`` column-wise (each rank holds a slice of the hidden units), ``fc2`` row-wise
(each rank's partial sum is reduced once at ``fc2``'s output). The input is replicated before
``fc1`` (a plain tensor input is taken as the full input on every rank).

With ``sequence_parallel=True`` the output is left sharded on tensor dim 1 (the sequence dim of a
(batch, seq, hidden) input): a reduce-scatter instead of an all-reduce; a ``Shard(1)`` DTensor input
is all-gathered before ``fc1``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule.plans.common import require, seq_or_replicate

__all__ = ["mlp_plan"]


def mlp_plan(model: nn.Module | None = None, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> dict[str, Any]:
    require(not loss_parallel, "mlp", "loss_parallel=True shards a language model's logits over the vocabulary; "
            "the MLP has none (its output is Replicate and comes back a plain tensor)")
    if model is not None:
        for name in ("fc1", "fc2"):
            require(isinstance(getattr(model, name, None), nn.Linear), "mlp", f"the model has no nn.Linear {name!r}")
    fc1_bias = model is None or model.fc1.bias is not None
    fc2_bias = model is None or model.fc2.bias is not None
    parameter: dict[str, Any] = {"fc1.weight": [Shard(0)], "fc2.weight": [Shard(1)]}
    if fc1_bias:
        parameter["fc1.bias"] = [Shard(0)]
    if fc2_bias:
        parameter["fc2.bias"] = [Replicate()]
    forward = {
        "fc1.input": [[Replicate()]],
        "fc2.output": [seq_or_replicate(sequence_parallel)],
    }
    return {"parameter": parameter, "forward": forward}
