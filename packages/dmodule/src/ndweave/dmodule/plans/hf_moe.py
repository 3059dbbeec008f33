"""Plans "hf_mixtral", "hf_qwen2_moe", "hf_qwen3_moe", "hf_deepseek_v3": transformers' MoE language
models (``MixtralForCausalLM``, ...), unchanged, expert parallel.

Each MoE layer keeps its experts stacked in one module, ``model.layers.<i>.mlp.experts``
(``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``), called with the router's ``top_k_index`` and
``top_k_weights``; ``expert_parallel=True`` names it for the ``"expert_parallel"`` patch, which
divides the experts over the mesh's ``"EP"`` dim and moves each rank's tokens to them and back
(``ndweave.dmodule.experts``)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "EP"))
    model = parallelize_module(model, mesh, get_plan("hf_mixtral", model, expert_parallel=True))
    model = DDP(model, mesh)            # dense grads over DP x EP, experts' over DP

- Routers, attention, norms, embeddings, Qwen2-MoE's ``shared_expert`` and DeepSeek-V3's
  ``shared_experts`` and first dense layers are dense: every rank holds them whole and runs them on its
  own tokens (EP splits the batch like DP).
- The router's auxiliary (load-balancing) loss, where the model computes it
  (``output_router_logits=True``), uses this rank's tokens' router statistics: it is not one
  process's loss over the global batch. With it off (the default) or its coefficient 0, training
  equals one process's (tested in float64).
- Tensor parallel too, on a mesh with a ``"TP"`` dim (``("DP", "EP", "TP")``): attention as
  ``"hf_llama"`` lays it out (Qwen2-MoE's q/k/v biases split with them; Qwen3-MoE's per-head
  ``q_norm`` / ``k_norm`` run on this rank's heads, their grads partial sums); the dense MLPs (Qwen's
  ``mlp_only_layers``, DeepSeek-V3's first layers) and the shared experts column- then row-wise;
  each MoE block takes its input back ``Replicate``, its router runs whole and its experts stay
  whole over TP (every TP rank runs its EP rank's experts on the same tokens) while they are
  divided over EP. DeepSeek-V3's multi-head latent attention stays whole on every TP rank (run on
  plain tensors, as "auto" finds it). On a mesh without ``"TP"`` the tensor-parallel entries change
  nothing. Sequence parallel is not written for any.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule.plans.common import config_of, require
from ndweave.dmodule.plans.hf_llama import llama_like_plan

__all__ = ["MOE_FAMILIES", "hf_moe_plan"]

#: Plan name -> the config field holding its number of routed experts.
MOE_FAMILIES = {
    "hf_mixtral": "num_local_experts",
    "hf_qwen2_moe": "num_experts",
    "hf_qwen3_moe": "num_experts",
    "hf_deepseek_v3": "n_routed_experts",
}
_L = r"model.layers.\d+"
_EXPERTS = rf"{_L}.mlp.experts"
#: The attention class of each family whose attention is Llama's (tensor parallel on local heads);
#: ``None``: kept whole on every tensor-parallel rank (DeepSeek-V3's latent attention).
_ATTENTION = {"hf_mixtral": "MixtralAttention", "hf_qwen2_moe": "Qwen2MoeAttention",
              "hf_qwen3_moe": "Qwen3MoeAttention", "hf_deepseek_v3": None}
#: The shared experts' module under each MoE block.
_SHARED = {"hf_qwen2_moe": "shared_expert", "hf_deepseek_v3": "shared_experts"}


def hf_moe_plan(name: str, model: nn.Module | None = None, *, sequence_parallel: bool = False,
                loss_parallel: bool = False, expert_parallel: bool = False) -> dict[str, Any]:
    """The plan of MoE family ``name`` (a key of :data:`MOE_FAMILIES`): experts over EP."""
    require(expert_parallel and not sequence_parallel, name,
            "divides the experts over EP (expert_parallel=True, without sequence_parallel): its other layouts "
            "are not in the zoo yet")
    if model is not None:
        config = config_of(model, name)
        experts, top_k = getattr(config, MOE_FAMILIES[name], None), getattr(config, "num_experts_per_tok", None)
        require(isinstance(experts, int) and isinstance(top_k, int), name,
                f"{type(model).__name__}'s config has no {MOE_FAMILIES[name]} / num_experts_per_tok: is it {name}?")
        require(top_k <= experts, name, f"top-k num_experts_per_tok={top_k} is more than the {experts} experts "
                f"({MOE_FAMILIES[name]}={experts}): each token needs top-k distinct experts")
    plan = llama_like_plan(model, name, _ATTENTION[name], dense_mlp=False, loss_parallel=loss_parallel)
    if name == "hf_qwen3_moe":  # RMSNorms over each head's features, on this rank's heads
        plan["patch"][rf"{_L}.self_attn.(q_norm|k_norm)"] = [{"name": "partial_grad_params",
                                                              "args": {"names": ["weight"]}}]
    for mlp in _dense_mlps(name, model):
        _swiglu(plan, mlp)
    plan["patch"][_EXPERTS] = ["expert_parallel"]
    return plan


def _dense_mlps(name: str, model: nn.Module | None) -> list[str]:
    """Regexes of the SwiGLU MLPs beside the experts: the shared experts of every MoE layer and,
    where the model has them, the dense layers' MLPs (read from the model: not every config has any)."""
    mlps = [f"{_L}.mlp.{_SHARED[name]}"] if name in _SHARED else []
    if model is not None and any(re.fullmatch(rf"{_L}.mlp.gate_proj", fqn) for fqn, _ in model.named_modules()):
        mlps.append(f"{_L}.mlp")
    return mlps


def _swiglu(plan: dict[str, Any], mlp: str) -> None:
    """Megatron's MLP layout: ``gate_proj`` / ``up_proj`` column-wise, ``down_proj`` row-wise (its
    partial sums all-reduced at its output); the MLP's input comes in ``Replicate``."""
    plan["parameter"][rf"{mlp}.(gate_proj|up_proj).weight"] = [Shard(0)]
    plan["parameter"][rf"{mlp}.down_proj.weight"] = [Shard(1)]
    plan["forward"][rf"{mlp}.down_proj.output"] = [[Replicate()]]
