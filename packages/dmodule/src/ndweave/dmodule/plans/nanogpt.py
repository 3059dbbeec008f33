"""Plan "nanogpt": the GPT of the job (``ndweave_gpt.models.nanogpt`` in ``examples/gpt``) (separate q/k/v projections, tied lm_head).

Tensor parallel (Megatron layout), per block::

    ln_1 -> q/k/v_proj (colwise: Shard(0) weight) -> attention on this rank's heads -> c_proj (rowwise)
    ln_2 -> c_fc (colwise) -> GELU -> c_proj (rowwise)

- q/k/v outputs leave as plain local tensors (``to_local``) so attention (``F.scaled_dot_product_attention``)
  runs on ordinary tensors on any device: DTensor has no CPU SDPA rule. ``c_proj`` takes its plain
  input back as ``Shard(-1)``; its output is ``Partial`` and is reduced there.
- ``wte``: vocab-parallel (``Shard(0)`` + the ``vocab_parallel_embedding`` patch); ``lm_head`` is
  column-wise over the vocabulary, tied or not (both get ``Shard(0)``, so a tied weight stays one
  parameter), and its logits are gathered and handed on as a plain full tensor, so the loss is
  computed as on one device (every rank holds the (batch, seq, vocab) logits). ``loss_parallel=True``
  leaves them ``Shard(-1)`` over the vocabulary for torch's ``loss_parallel()`` cross-entropy.
- ``sequence_parallel=True``: the residual stream, LayerNorms and dropout are ``Shard(1)`` on the
  sequence; each LayerNorm's output is all-gathered before the projections and each row-wise
  output is reduce-scattered. LayerNorm weights then get ``Partial`` gradients, which
  ``finish_grad_sync()`` reduces.

Needs ``n_head`` divisible by the mesh size (checked at ``parallelize_module`` time: by the generic
``tp_divides`` patch with the head count read from ``model``; a plan made without the model uses
``nanogpt_attention_heads``, which reads it off each attention module's projection rows, as the
module keeps no head count of its own).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule.patches import register_patch
from ndweave.dmodule.plans.common import config_of, local, logits_output, require, seq_or_replicate

__all__ = ["nanogpt_plan", "check_attention_heads"]

_H = r"transformer.h.\d+"


def nanogpt_plan(model: nn.Module | None = None, *, sequence_parallel: bool = False,
                 loss_parallel: bool = False) -> dict[str, Any]:
    bias = True
    heads_check: Any = "nanogpt_attention_heads"  # no model: the head count is read off each module
    if model is not None:
        config = config_of(model, "nanogpt")
        require(hasattr(model, "transformer") and hasattr(model, "lm_head"), "nanogpt",
                f"{type(model).__name__} is not the GPT of the job, ndweave_gpt.models.nanogpt (no .transformer / .lm_head)")
        require(config.n_embd % config.n_head == 0, "nanogpt",
                f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
        bias = config.bias
        heads_check = {"name": "tp_divides", "args": {"sizes": {"n_head": config.n_head}}}
    stream = seq_or_replicate(sequence_parallel)

    parameter: dict[str, Any] = {
        "transformer.wte.weight": [Shard(0)],
        rf"{_H}.attn.(q_proj|k_proj|v_proj).weight": [Shard(0)],
        rf"{_H}.attn.c_proj.weight": [Shard(1)],
        rf"{_H}.mlp.c_fc.weight": [Shard(0)],
        rf"{_H}.mlp.c_proj.weight": [Shard(1)],
        "lm_head.weight": [Shard(0)],
    }
    if bias:
        parameter.update({
            rf"{_H}.attn.(q_proj|k_proj|v_proj).bias": [Shard(0)],
            rf"{_H}.attn.c_proj.bias": [Replicate()],
            rf"{_H}.mlp.c_fc.bias": [Shard(0)],
            rf"{_H}.mlp.c_proj.bias": [Replicate()],
        })

    forward: dict[str, Any] = {
        "transformer.wte.output": [stream],
        "transformer.wpe.input": [[Replicate()]],  # positions: a plain arange, the same on every rank
        rf"{_H}.attn.(q_proj|k_proj|v_proj).output": [local([Shard(-1)])],
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
        "class:CausalSelfAttention": [heads_check],
    }
    return {"parameter": parameter, "forward": forward, "patch": patch}


@register_patch("nanogpt_attention_heads")
def check_attention_heads(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Patch: fail early, naming the module and mesh, when the heads do not split evenly. For plans
    made without the model: the module keeps no head count, so it is read off ``q_proj``'s rows
    (``tp_divides`` is given it when the plan is made with the model)."""
    num_heads = module.q_proj.weight.shape[0] // module.head_dim
    if num_heads % device_mesh.size() != 0:
        raise ValueError(
            f"{fqn}: {num_heads} attention heads do not split over the {device_mesh.size()} ranks of {device_mesh}; "
            "the nanogpt plan needs n_head divisible by the tensor-parallel size"
        )
