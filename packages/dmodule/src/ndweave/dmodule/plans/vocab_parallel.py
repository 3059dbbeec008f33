"""``vocab_parallel_embedding``: the patch every language-model plan of the zoo names (the per-model
patches live beside their plan), registered in ``ndweave.dmodule.patches`` under that name (plans
name their patches so they stay JSON).

A patch is ``patch(module, device_mesh, fqn) -> None``; it runs after the module's parameters are
distributed and before forward hooks, and may replace ``module.forward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ndweave.dmodule.patches import register_patch
from ndweave.mesh.torch_compat import local_shape_and_offset

__all__ = ["vocab_parallel_embedding"]


@register_patch("vocab_parallel_embedding")
def vocab_parallel_embedding(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Make an ``nn.Embedding`` whose weight is ``Shard(0)`` (rows = vocabulary) look up only its
    local rows.

    Each rank masks the ids outside its row range, looks up the rest in its local shard and returns
    zeros for the masked ones; the output is a ``Partial`` DTensor (sum over ranks = the full
    lookup), which the plan's output placement reduces (``Replicate``: all-reduce; ``Shard(1)``:
    reduce-scatter). The vocabulary need not divide by the mesh size (GPT-2's 50257 over 2 ranks is
    25129 + 25128 rows). The weight's gradient stays ``Shard(0)``: no rank ever holds a full one.
    """
    weight = module.weight
    placements = tuple(weight.placements) if isinstance(weight, DTensor) else ()
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    others_ok = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in shard_dims)
    if len(shard_dims) != 1 or not others_ok or type(placements[shard_dims[0]]) is not Shard:
        raise ValueError(
            f"vocab_parallel_embedding on {fqn!r}: {fqn}.weight must be sharded [Shard(0)] on one mesh dim "
            f"(Replicate on the others); it is {placements or 'a plain tensor'} on {device_mesh}"
        )
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise ValueError(
            f"vocab_parallel_embedding on {fqn!r}: max_norm, sparse and scale_grad_by_freq are not supported"
        )
    local_shape, global_offset = local_shape_and_offset(weight.shape, weight.device_mesh, placements)
    start, stop = global_offset[0], global_offset[0] + local_shape[0]
    padding_idx = module.padding_idx
    local_padding_idx = padding_idx - start if padding_idx is not None and start <= padding_idx < stop else None
    out_placements = [Partial() if i == shard_dims[0] else Replicate() for i in range(len(placements))]

    def forward(input: torch.Tensor) -> DTensor:
        ids = input
        if isinstance(ids, DTensor):
            if not all(isinstance(p, Replicate) for p in ids.placements):
                ids = ids.redistribute(ids.device_mesh, [Replicate()] * ids.device_mesh.ndim)
            ids = ids.to_local()
        outside = (ids < start) | (ids >= stop)
        local_ids = torch.where(outside, torch.zeros_like(ids), ids - start)
        out = F.embedding(local_ids, module.weight.to_local(), local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return DTensor.from_local(out, module.weight.device_mesh, out_placements, run_check=False)

    module.forward = forward
    module.vocab_range = (start, stop)  # for dump/debugging: the rows this rank holds

