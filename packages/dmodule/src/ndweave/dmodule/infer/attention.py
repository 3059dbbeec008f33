"""torch's own attention: ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``).

Its projections are no modules of their own: one fused ``in_proj_weight`` parameter and the
``out_proj`` weight, both used inside ``F.multi_head_attention_forward``, which also derives the
head size from the *input's* width, so no attribute change makes it run on local heads. It is found
by that call in the trace (self-attention: query, key and value one tensor; one fused projection; no
``bias_k`` / ``add_zero_attn``; ``need_weights=False``, as ``nn.TransformerEncoderLayer`` calls it)
and gets Megatron's layout with a patch of its own, ``multihead_attention_local``: ``in_proj``
``_StridedShard(0, split_factor=3)`` (each rank its heads of q, k and v), ``out_proj.weight``
``Shard(1)``, and a forward computing this rank's heads with ``F.scaled_dot_product_attention``,
its output a partial sum the plan reduces like any row-wise output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ndweave.dmodule.infer.entries import Entries
from ndweave.dmodule.patches import register_patch
from ndweave.mesh.torch_compat import StridedShard
from ndweave.dmodule.infer.trace import Op, Ref, Trace

__all__ = ["TorchAttention", "emit_torch_attention", "find_torch_attention", "multihead_attention_local"]

_MHA = "F.multi_head_attention_forward"
_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k",
         "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias")


@dataclass(frozen=True)
class TorchAttention:
    """One ``nn.MultiheadAttention`` call the plan can shard."""

    op: int
    """Index of its ``F.multi_head_attention_forward`` op."""
    module: str
    in_proj: tuple[str, str | None]
    """FQNs of ``in_proj_weight`` and ``in_proj_bias``."""
    out_proj: tuple[str, str | None]
    heads: int


def _call_args(op: Op) -> dict[str, Any]:
    return {**dict(zip(_ARGS, op.args)), **op.kwargs}


def find_torch_attention(trace: Trace) -> tuple[list[TorchAttention], dict[int, str]]:
    """The shardable ``nn.MultiheadAttention`` calls, and op index -> why for those that are not."""
    found, skipped = [], {}
    for op in trace.ops:
        if op.name != _MHA:
            continue
        a = _call_args(op)
        refs = [a.get(k) for k in ("query", "key", "value")]
        params = {k: trace.values[a[k].id].param if isinstance(a.get(k), Ref) else None
                  for k in ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias")}
        one_input = len({r.id for r in refs if isinstance(r, Ref)}) == 1
        fused = not a.get("use_separate_proj_weight") and params["in_proj_weight"]
        why = ("query, key and value differ (not self-attention)" if not one_input
               else "separate q/k/v projection weights" if not fused
               else "bias_k / bias_v / add_zero_attn" if a.get("bias_k") is not None or a.get("add_zero_attn")
               else "need_weights=True (each rank holds only its heads' weights)" if a.get("need_weights", True)
               else None)
        if why:
            skipped[op.index] = f"{op.module}: nn.MultiheadAttention left replicated: {why}"
            continue
        found.append(TorchAttention(op.index, op.module, (params["in_proj_weight"], params["in_proj_bias"]),
                                    (params["out_proj_weight"], params["out_proj_bias"]), a["num_heads"]))
    return found, skipped


def emit_torch_attention(entries: Entries, found: list[TorchAttention], *, sequence_parallel: bool) -> None:
    stream = [Shard(1)] if sequence_parallel else [Replicate()]
    for att in found:
        weight, bias = att.in_proj
        entries.param(weight, [StridedShard(0, split_factor=3)], "nn.MultiheadAttention's fused q|k|v: each rank "
                      "keeps its heads of q, k and v")
        if bias is not None:
            entries.param(bias, [StridedShard(0, split_factor=3)], "its bias, likewise")
        weight, bias = att.out_proj
        entries.param(weight, [Shard(1)], "nn.MultiheadAttention's out_proj: row-wise over the heads")
        if bias is not None:
            entries.param(bias, [Replicate()], "out_proj's bias: added once")
        entries.add("forward", att.module, "output", [stream, None],
                    "the heads' partial sums reduce-scattered on the sequence (SP)" if sequence_parallel
                    else "the heads' partial sums all-reduced, once")
        entries.add("patch", att.module, "", "multihead_attention_local",
                    "computes this rank's heads (F.scaled_dot_product_attention on local tensors)")
        entries.add("patch", att.module, "", {"name": "tp_divides", "args": {"sizes": [att.heads]}},
                    "checks that the tensor-parallel size divides the heads")


@register_patch("multihead_attention_local")
def multihead_attention_local(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Patch for ``nn.MultiheadAttention``: self-attention on this rank's heads (see the module docstring)."""
    if device_mesh.ndim != 1 or module.in_proj_weight is None or module.bias_k is not None or module.add_zero_attn:
        raise ValueError(f"{fqn}: multihead_attention_local needs a 1-D mesh and one fused in_proj_weight without "
                         "bias_k / bias_v / add_zero_attn")
    tp = device_mesh.size()
    if module.num_heads % tp:
        raise ValueError(f"{fqn}: num_heads={module.num_heads} does not split over the {tp} ranks of {device_mesh}")
    heads = module.num_heads // tp

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not (query is key is value):
            raise ValueError(f"{fqn}: under tensor parallelism only self-attention (query is key is value) "
                             "is supported")
        if need_weights:
            raise ValueError(f"{fqn}: each rank holds only its heads; call it with need_weights=False")
        x = _replicated_local(query, device_mesh)
        if not module.batch_first:
            x = x.transpose(0, 1)
        batch, seq, _ = x.shape
        bias = module.in_proj_bias.to_local() if module.in_proj_bias is not None else None
        q, k, v = (t.view(batch, seq, heads, module.head_dim).transpose(1, 2)
                   for t in F.linear(x, module.in_proj_weight.to_local(), bias).chunk(3, dim=-1))
        mask = _mask(attn_mask, key_padding_mask, batch, seq, heads, device_mesh, q.dtype)
        dropout = module.dropout if module.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None)
        y = DTensor.from_local(y.transpose(1, 2).reshape(batch, seq, heads * module.head_dim), device_mesh,
                               [Shard(-1)], run_check=False)
        out = F.linear(y, module.out_proj.weight, module.out_proj.bias)  # a partial sum: the plan reduces it
        return (out if module.batch_first else out.transpose(0, 1)), None

    module.forward = forward


def _replicated_local(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` whole on every rank, as a plain tensor whose gradient is this rank's partial sum."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    elif x.placements != (Replicate(),):
        x = x.redistribute(mesh, [Replicate()])
    return x.to_local(grad_placements=[Partial()])


def _mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, batch: int, seq: int, heads: int,
          mesh: DeviceMesh, dtype: torch.dtype) -> torch.Tensor | None:
    """One additive mask for SDPA from nn.MultiheadAttention's (True = masked out, or additive)."""
    def additive(m: torch.Tensor) -> torch.Tensor:
        m = m.to_local() if isinstance(m, DTensor) else m
        if m.dtype != torch.bool:
            return m.to(dtype)
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))

    out = None
    if attn_mask is not None:
        out = additive(attn_mask)
        if out.dim() == 3:  # (batch * num_heads, seq, seq): this rank's heads
            rank = mesh.get_local_rank()
            out = out.view(batch, -1, seq, seq)[:, rank * heads:(rank + 1) * heads]
    if key_padding_mask is not None:
        pad = additive(key_padding_mask).view(batch, 1, 1, seq)
        out = pad if out is None else out + pad
    return out
