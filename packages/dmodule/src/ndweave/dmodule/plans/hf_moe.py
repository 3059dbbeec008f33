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
- ``"hf_mixtral"`` is tensor parallel too, on a mesh with a ``"TP"`` dim (``("DP", "EP", "TP")``):
  attention as ``"hf_llama"`` lays it out; each MoE block takes its input back ``Replicate`` and its
  experts stay whole over TP (every TP rank runs its EP rank's experts on the same tokens) while
  they are divided over EP. On a mesh without ``"TP"`` its tensor-parallel entries change nothing.
  The other families' tensor-parallel layouts (DeepSeek-V3's latent attention, the shared experts)
  are not written yet: use a mesh without ``"TP"``. Sequence parallel is not written for any.
"""

from __future__ import annotations

from typing import Any

from torch import nn

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
_EXPERTS = r"model.layers.\d+.mlp.experts"


def hf_moe_plan(name: str, model: nn.Module | None = None, *, sequence_parallel: bool = False,
                loss_parallel: bool = False, expert_parallel: bool = False) -> dict[str, Any]:
    """The plan of MoE family ``name`` (a key of :data:`MOE_FAMILIES`): experts over EP."""
    require(expert_parallel and not sequence_parallel, name,
            "divides the experts over EP (expert_parallel=True, without sequence_parallel): its other layouts "
            "are not in the zoo yet")
    require(name == "hf_mixtral" or not loss_parallel, name, "loss_parallel needs the tensor-parallel layout, "
            "which only hf_mixtral has so far")
    if model is not None:
        config = config_of(model, name)
        experts, top_k = getattr(config, MOE_FAMILIES[name], None), getattr(config, "num_experts_per_tok", None)
        require(isinstance(experts, int) and isinstance(top_k, int), name,
                f"{type(model).__name__}'s config has no {MOE_FAMILIES[name]} / num_experts_per_tok: is it {name}?")
        require(top_k <= experts, name, f"top-k num_experts_per_tok={top_k} is more than the {experts} experts "
                f"({MOE_FAMILIES[name]}={experts}): each token needs top-k distinct experts")
    plan: dict[str, Any] = {"parameter": {}, "forward": {}, "patch": {}}
    if name == "hf_mixtral":
        plan = llama_like_plan(model, name, "MixtralAttention", dense_mlp=False, loss_parallel=loss_parallel)
    plan["patch"][_EXPERTS] = ["expert_parallel"]
    return plan
