"""Plan "hf_gpt2": transformers' ``GPT2LMHeadModel``, unchanged (vocab 50257, tied ``lm_head``).

GPT-2's projections are ``Conv1D``: weight (in, out), the transpose of ``nn.Linear``. So column-wise
is ``Shard(1)`` on the weight (bias ``Shard(0)``) and row-wise ``Shard(0)`` (bias ``Replicate``).

The fused ``c_attn`` (weight (E, 3E) = [q | k | v]) is the catch: ``Shard(1)`` would give rank 0 all
of q and half of k. The parameter stays the original (E, 3E) tensor, laid out
``_StridedShard(1, split_factor=3)``: rank r holds columns [q_r | k_r | v_r], its own heads of each.
``full_tensor()``, checkpoints and gradients see the unchanged HF layout; only the local shards are
strided. The plan and the generic patches ``get_plan("auto")`` also emits make the module use it:

- the parameter section lays weight and bias out ``_StridedShard(1 / 0, split_factor=3)``, so even
  under ``deferred_init`` a rank only ever keeps its own columns;
- ``fused_colwise(pieces=3)`` (on each ``c_attn``): checks that layout, then runs ``Conv1D``'s own
  ``x @ w_local + b_local`` on local tensors and returns the plain local [q_r | k_r | v_r]
  (all-gathering a sequence-sharded input first);
- on each ``attn``: ``tp_divides(attributes=["num_heads"])`` checks that ``n_head`` divides by the
  mesh size, then ``divide_attributes(names=["c_attn.nf", "split_size"])`` sets the local output
  width (3E / tp) and ``split_size`` to E / tp, so the local output splits into local q, k, v;
  heads are reshaped with ``-1`` already.

(``hf_gpt2_fused_qkv`` and ``hf_gpt2_attention_local_heads``, the patches the plan named before,
stay registered for one release so saved plans load; they warn ``DeprecationWarning``.)

Then ``attn.c_proj`` takes its plain input back as ``Shard(-1)`` and reduces its ``Partial`` output.
``wte`` is vocab-parallel (50257 rows over 2 ranks: 25129 + 25128); ``lm_head`` shares the very same
weight (``Shard(0)`` on both sides keeps it one parameter), its logits are gathered and handed on as
a plain tensor so HF's loss runs unchanged (``loss_parallel=True``: left ``Shard(-1)``). ``wpe``
takes the model's plain ``position_ids`` as ``Replicate`` (no factory mode needed).
``sequence_parallel=True``: as for Llama — residual stream, LayerNorms and dropout ``Shard(1)``;
LayerNorm outputs all-gathered; row-wise outputs reduce-scattered.
Eager and SDPA attention both work; cross-attention (``add_cross_attention``) is not supported
(``hf_gpt2_plan(model)`` refuses it; the patches above touch only each block's self-attention ``attn``).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from ndweave.dmodule.patches import register_patch
from ndweave.dmodule.plans.common import config_of, logits_output, require, seq_or_replicate, warn_deprecated_patch
from ndweave.mesh.torch_compat import StridedShard

__all__ = ["hf_gpt2_plan", "attention_local_heads", "fused_qkv_colwise"]

_H = r"transformer.h.\d+"


def hf_gpt2_plan(model: nn.Module | None = None, *, sequence_parallel: bool = False,
                 loss_parallel: bool = False) -> dict[str, Any]:
    if model is not None:
        config = config_of(model, "hf_gpt2")
        require(hasattr(model, "transformer") and hasattr(model, "lm_head"), "hf_gpt2",
                f"{type(model).__name__} does not look like GPT2LMHeadModel (transformer, lm_head)")
        require(not getattr(config, "add_cross_attention", False), "hf_gpt2",
                "cross-attention (add_cross_attention=True) is not supported")
    stream = seq_or_replicate(sequence_parallel)

    parameter: dict[str, Any] = {
        "transformer.wte.weight": [Shard(0)],
        # fused [q | k | v]: rank r keeps its own [q_r | k_r | v_r] columns (plain Shard(1) would mix heads)
        rf"{_H}.attn.c_attn.weight": [StridedShard(1, split_factor=3)],
        rf"{_H}.attn.c_attn.bias": [StridedShard(0, split_factor=3)],
        rf"{_H}.attn.c_proj.weight": [Shard(0)],
        rf"{_H}.attn.c_proj.bias": [Replicate()],
        rf"{_H}.mlp.c_fc.weight": [Shard(1)],
        rf"{_H}.mlp.c_fc.bias": [Shard(0)],
        rf"{_H}.mlp.c_proj.weight": [Shard(0)],
        rf"{_H}.mlp.c_proj.bias": [Replicate()],
        "lm_head.weight": [Shard(0)],
    }
    forward: dict[str, Any] = {
        "transformer.wte.output": [stream],
        "transformer.wpe.input": [[Replicate()]],
        rf"{_H}.attn.c_proj.input": [[Shard(-1)]],
        rf"{_H}.attn.c_proj.output": [stream],
        rf"{_H}.mlp.c_proj.output": [stream],
        "lm_head.output": logits_output(loss_parallel),
    }
    if sequence_parallel:
        forward.update({
            "transformer.wpe.output": [[Shard(1)]],
            rf"{_H}.(ln_1|ln_2).output": [[Replicate()]],
            "transformer.ln_f.output": [[Replicate()]],
        })
    patch = {
        "transformer.wte": ["vocab_parallel_embedding"],
        rf"{_H}.attn.c_attn": [_fused_qkv()],
        rf"{_H}.attn": _attention_local_heads(),
    }
    return {"parameter": parameter, "forward": forward, "patch": patch}


def _fused_qkv() -> dict[str, Any]:
    return {"name": "fused_colwise", "args": {"pieces": 3}}


def _attention_local_heads() -> list[dict[str, Any]]:
    return [{"name": "tp_divides", "args": {"attributes": ["num_heads"]}},
            {"name": "divide_attributes", "args": {"names": ["c_attn.nf", "split_size"]}}]


@register_patch("hf_gpt2_attention_local_heads")
def attention_local_heads(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Deprecated patch for ``GPT2Attention`` (plans saved before the zoo used the generic patches;
    removed next release): split the local fused output into local q, k, v. Warns, then does it."""
    warn_deprecated_patch("hf_gpt2_attention_local_heads", json.dumps(_attention_local_heads()))
    _require_1d(device_mesh, fqn)
    tp = device_mesh.size()
    if getattr(module, "is_cross_attention", False):
        raise ValueError(f"{fqn}: cross-attention is not supported by the hf_gpt2 plan")
    if module.num_heads % tp:
        raise ValueError(
            f"{fqn}: n_head={module.num_heads} does not split over the {tp} ranks of {device_mesh}; "
            "the hf_gpt2 plan needs n_head divisible by the tensor-parallel size"
        )
    module.split_size = module.embed_dim // tp


def _require_1d(device_mesh: DeviceMesh, fqn: str) -> None:
    if device_mesh.ndim != 1:
        raise ValueError(f"{fqn}: the hf_gpt2 plan is for a 1-D tensor-parallel mesh, not {device_mesh}")


@register_patch("hf_gpt2_fused_qkv")
def fused_qkv_colwise(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Deprecated patch for a fused-qkv ``Conv1D`` (plans saved before the zoo used
    ``fused_colwise``; removed next release): per-rank [q_r | k_r | v_r] columns, computed locally.
    Warns, then does it.

    The plan's parameter section lays weight and bias out ``_StridedShard(1 / 0, split_factor=3)``;
    any other layout (``Replicate`` from a plan that left them out, plain ``Shard``, which would mix
    q, k and v heads across ranks) is refused here rather than silently re-laid: re-laying a
    replicated weight would cost every rank the full (E, 3E) tensor.
    """
    warn_deprecated_patch("hf_gpt2_fused_qkv", json.dumps(_fused_qkv()))
    _require_1d(device_mesh, fqn)
    for name, dim in (("weight", 1), ("bias", 0)):
        param = getattr(module, name)
        want = (StridedShard(dim, split_factor=3),)
        got = tuple(param.placements) if isinstance(param, DTensor) else "a plain tensor"
        if got != want:
            raise ValueError(
                f"{fqn}.{name}: the fused q|k|v projection must be laid out {list(want)} (rank r holds its own "
                f"q, k and v columns), given in the plan's parameter section; it is {got}"
            )

    def forward(x: torch.Tensor) -> torch.Tensor:
        mesh = module.weight.device_mesh
        if not isinstance(x, DTensor):  # a plain input is the full activation, the same on every rank
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        elif x.placements != (Replicate(),):
            # (only when needed: even a no-op redistribute would turn the Partial gradient below
            # into an all-reduce where a sequence-parallel reduce-scatter suffices)
            x = x.redistribute(mesh, [Replicate()])
        # each rank's input gradient covers only its own heads: a partial sum, reduced on the way back
        x = x.to_local(grad_placements=[Partial()])
        weight, bias = module.weight.to_local(), module.bias.to_local()
        out = torch.addmm(bias, x.reshape(-1, x.size(-1)), weight)
        return out.view(*x.shape[:-1], weight.shape[-1])

    module.forward = forward
