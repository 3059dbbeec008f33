"""Plan "hf_llama": transformers' ``LlamaForCausalLM``, unchanged, grouped-query attention included.

Tensor parallel, per decoder layer::

    input_layernorm -> q/k/v_proj (colwise) -> RoPE + attention on local heads -> o_proj (rowwise)
    post_attention_layernorm -> gate/up_proj (colwise) -> SiLU * -> down_proj (rowwise)

- Attention runs on plain local tensors: q/k/v outputs are handed on ``to_local`` (``Shard(-1)`` =
  this rank's heads) and ``o_proj`` takes its input back as ``Shard(-1)``. Llama reshapes with
  ``view(..., -1, head_dim)``, so no head count needs patching; with ``num_attention_heads / tp``
  query heads and ``num_key_value_heads / tp`` key/value heads per rank, ``num_key_value_groups``
  (their ratio) is unchanged and each local query head meets its own key/value head. Both head
  counts must divide by the mesh size (the generic ``tp_divides`` patch checks both, read off the
  attention module's config when the patch runs).
  Eager and SDPA attention both work (they see plain tensors).
- RoPE: ``rotary_emb``'s ``inv_freq`` is a non-persistent buffer, which ``parallelize_module``
  leaves a plain tensor; with the model's plain ``position_ids`` it computes plain ``cos`` / ``sin``
  for the local heads: no plan entry, no factory mode.
- ``embed_tokens``: vocab-parallel (``Shard(0)`` + ``vocab_parallel_embedding``); ``lm_head``:
  column-wise, logits gathered and handed on as a plain tensor so HF's loss runs unchanged (with
  ``loss_parallel=True``: left ``Shard(-1)`` for torch's ``loss_parallel()``).
  Tied embeddings (``tie_word_embeddings=True``) stay one parameter: both sides are ``Shard(0)``.
- Tensor parallel only: each RMSNorm's output is handed on as a plain tensor and taken back as
  ``Replicate`` by its consumer (``self_attn`` / ``mlp`` / ``lm_head``), so the projections'
  partial input gradient is all-reduced right there, once per block (RMSNorm is pointwise ops that
  would otherwise carry the ``Partial`` gradient back into ``o_proj`` / ``down_proj``, whose weight
  gradients would then be full-size ``Partial`` tensors on every rank).
- ``sequence_parallel=True``: residual stream and RMSNorms ``Shard(1)`` on the sequence; every
  norm's output is all-gathered (its backward: a reduce-scatter), ``o_proj`` / ``down_proj``
  outputs reduce-scattered; the norms' weight gradients come out ``Partial`` and
  ``finish_grad_sync()`` reduces them.
"""

from __future__ import annotations

import json
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule.patches import register_patch
from ndweave.dmodule.plans.common import (config_of, local, logits_output, require, seq_or_replicate,
                                          warn_deprecated_patch)

__all__ = ["hf_llama_plan", "check_attention_heads", "llama_like_plan"]

_L = r"model.layers.\d+"


def _heads_check() -> dict[str, Any]:
    """Both head counts must split over the ranks (an uneven cut of q_proj's rows would halve a head
    and compute garbage silently): read off the module's config, so the plan needs no model."""
    return {"name": "tp_divides", "args": {"attributes": ["config.num_attention_heads", "config.num_key_value_heads"]}}


def hf_llama_plan(model: nn.Module | None = None, *, sequence_parallel: bool = False,
                  loss_parallel: bool = False) -> dict[str, Any]:
    return llama_like_plan(model, "hf_llama", "LlamaAttention", dense_mlp=True, sequence_parallel=sequence_parallel,
                           loss_parallel=loss_parallel)


def llama_like_plan(model: nn.Module | None, name: str, attention_class: str | None, *, dense_mlp: bool,
                    sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, Any]:
    """The plan of a Llama-like decoder (plan ``name``, attention class ``attention_class``). Its MLP
    is Llama's (``dense_mlp``) or another module taking the norm's output back ``Replicate`` (an MoE
    block, whose experts the ``expert_parallel`` patch places). ``attention_class=None``: attention
    of another shape (DeepSeek-V3's latent attention) stays whole, run by every rank on plain
    tensors (``replicated_local``)."""
    attention_bias = qkv_bias = mlp_bias = False  # Llama's defaults
    if model is not None:
        config = config_of(model, name)
        require(hasattr(model, "model") and hasattr(model.model, "layers") and hasattr(model, "lm_head"), name,
                f"{type(model).__name__} does not look like a Llama-like causal LM (model.layers, lm_head)")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        require(heads % kv_heads == 0, name,
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or bool(getattr(config, "qkv_bias", False))  # Qwen2-MoE: q/k/v only
        mlp_bias = bool(getattr(config, "mlp_bias", False))
    stream = seq_or_replicate(sequence_parallel)

    parameter: dict[str, Any] = {"model.embed_tokens.weight": [Shard(0)], "lm_head.weight": [Shard(0)]}
    if attention_class is not None:
        parameter[rf"{_L}.self_attn.(q_proj|k_proj|v_proj).weight"] = [Shard(0)]
        parameter[rf"{_L}.self_attn.o_proj.weight"] = [Shard(1)]
    if dense_mlp:
        parameter[rf"{_L}.mlp.(gate_proj|up_proj).weight"] = [Shard(0)]
        parameter[rf"{_L}.mlp.down_proj.weight"] = [Shard(1)]
    if qkv_bias and attention_class is not None:
        parameter[rf"{_L}.self_attn.(q_proj|k_proj|v_proj).bias"] = [Shard(0)]
    if attention_bias and attention_class is not None:
        parameter[rf"{_L}.self_attn.o_proj.bias"] = [Replicate()]
    if mlp_bias and dense_mlp:
        parameter[rf"{_L}.mlp.(gate_proj|up_proj).bias"] = [Shard(0)]
        parameter[rf"{_L}.mlp.down_proj.bias"] = [Replicate()]

    forward: dict[str, Any] = {"model.embed_tokens.output": [stream], "lm_head.output": logits_output(loss_parallel)}
    if attention_class is not None:
        forward[rf"{_L}.self_attn.(q_proj|k_proj|v_proj).output"] = [local([Shard(-1)])]
        forward[rf"{_L}.self_attn.o_proj.input"] = [[Shard(-1)]]
        forward[rf"{_L}.self_attn.o_proj.output"] = [stream]
    if dense_mlp:
        forward[rf"{_L}.mlp.down_proj.output"] = [stream]
    norms = rf"{_L}.(input_layernorm|post_attention_layernorm)"
    if sequence_parallel:
        forward[f"{norms}.output"] = [[Replicate()]]
        forward["model.norm.output"] = [[Replicate()]]
    else:
        # RMSNorm is plain pointwise ops, through which DTensor would carry the projections' Partial
        # input gradient all the way back (o_proj / down_proj would get full-size Partial weight
        # gradients). Handing the norm output over as a local tensor and taking it back as Replicate
        # at its consumer puts the backward all-reduce right there (Megatron's "f").
        forward[f"{norms}.output"] = [local([Replicate()])]
        forward[rf"{_L}.self_attn.input"] = {"hidden_states": [Replicate()]}
        forward[rf"{_L}.mlp.input"] = [[Replicate()]]
        forward["model.norm.output"] = [local([Replicate()])]
        forward["lm_head.input"] = [[Replicate()]]

    patch = {"model.embed_tokens": ["vocab_parallel_embedding"],
             **({f"class:{attention_class}": [_heads_check()]} if attention_class is not None
                else {rf"{_L}.self_attn": ["replicated_local"]})}
    if sequence_parallel:  # the RMSNorms (~16 DTensor ops a step each) on their sequence shards as plain tensors
        patch[norms], patch["model.norm"] = ["pointwise_local"], ["pointwise_local"]
    return {"parameter": parameter, "forward": forward, "patch": patch}


@register_patch("hf_llama_attention_heads")
def check_attention_heads(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Deprecated patch (plans saved before the zoo used ``tp_divides``; removed next release): both
    head counts must split evenly over the mesh. Warns, then checks as it did."""
    warn_deprecated_patch("hf_llama_attention_heads", json.dumps(_heads_check()))
    config = module.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tp = device_mesh.size()
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"{fqn}: num_attention_heads={heads} and num_key_value_heads={kv_heads} must both be divisible by "
            f"the tensor-parallel size {tp} ({device_mesh}); pick a mesh size that divides {kv_heads}"
        )
