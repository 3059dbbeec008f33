"""The plan zoo: ready-made ``sharding_plan`` dicts for known models.

    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    model = parallelize_module(model, tp_mesh, get_plan("hf_llama", model, sequence_parallel=True))

``get_plan(name, model=None, *, sequence_parallel=False, loss_parallel=False, expert_parallel=False)``
returns a fresh plan (edit it freely); ``model`` lets the plan read its config (biases, head counts)
and fail early with a clear message.
Plans are for a 1-D tensor-parallel mesh (or a 1-D submesh of a ``ParallelMesh``). The patches a
plan needs are named inside it (``"patch"`` section) and registered with
``ndweave.dmodule.register_patch`` as the zoo's modules are defined, so a plan is plain data: ``save_plan`` / ``load_plan`` write and read it as JSON.

| name      | model                                   | module          |
|-----------|-----------------------------------------|-----------------|
| "mlp"     | the README's fc1 -> ReLU -> fc2 MLP      | ``plans.mlp``     |
| "nanogpt" | ``examples/gpt/model.py``'s GPT          | ``plans.nanogpt`` |
| "hf_llama"| transformers ``LlamaForCausalLM``        | ``plans.hf_llama``|
| "hf_gpt2" | transformers ``GPT2LMHeadModel``         | ``plans.hf_gpt2`` |
| "hf_mixtral", "hf_qwen2_moe", "hf_qwen3_moe", "hf_deepseek_v3" | transformers' MoE models, experts over EP | ``plans.hf_moe`` |
| "auto"    | any model: derived from one traced forward | ``infer.auto``  |
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ndweave.dmodule.infer.auto import auto_plan
from ndweave.dmodule.infer.explain import explain_plan
from ndweave.dmodule.plans.hf_gpt2 import hf_gpt2_plan
from ndweave.dmodule.plans.hf_llama import hf_llama_plan
from ndweave.dmodule.plans.hf_moe import MOE_FAMILIES, hf_moe_plan
from ndweave.dmodule.plans.mlp import mlp_plan
from ndweave.dmodule.plans.nanogpt import nanogpt_plan
from ndweave.dmodule.plans.serialization import load_plan, save_plan
from ndweave.dmodule.plans.vocab_parallel import vocab_parallel_embedding

__all__ = ["explain_plan", "get_plan", "list_plans", "load_plan", "save_plan", "vocab_parallel_embedding"]

_PLANS: dict[str, Callable[..., dict[str, Any]]] = {
    "auto": auto_plan,
    "mlp": mlp_plan,
    "nanogpt": nanogpt_plan,
    "hf_llama": hf_llama_plan,
    "hf_gpt2": hf_gpt2_plan,
    **{name: functools.partial(hf_moe_plan, name) for name in MOE_FAMILIES},
}


def list_plans() -> list[str]:
    """The names ``get_plan`` knows."""
    return sorted(_PLANS)


def get_plan(name: str, model: Any = None, *, sequence_parallel: bool = False,
             loss_parallel: bool = False, expert_parallel: bool = False,
             example_inputs: tuple[tuple, dict] | None = None) -> dict[str, Any]:
    """A ``sharding_plan`` (``{"parameter": ..., "forward": ..., "patch": ...}``) for model family
    ``name``: tensor parallel, plus sequence parallel on the residual stream when
    ``sequence_parallel=True``. Pass ``model`` to size the plan from its config (biases, heads).

    ``name="auto"`` derives the plan from ``model`` (one forward traced on meta; ``example_inputs=
    (args, kwargs)`` where its inputs cannot be guessed: see ``ndweave.dmodule.infer``).

    ``expert_parallel=True`` (the MoE families, and "auto"): the experts are divided over the mesh's
    ``"EP"`` dim (``parallelize_module(model, mesh, plan)`` with a mesh holding ``"EP"``); a family
    (or a model) without experts refuses it.

    ``loss_parallel=True`` (the language models): the logits stay ``Shard(-1)`` DTensors over the
    vocabulary instead of being gathered; compute the loss outside the model and run it AND its
    backward inside torch's ``loss_parallel()``::

        from torch.distributed.tensor.parallel import loss_parallel

        logits, _ = model(idx)                      # (batch, seq, vocab), Shard(-1)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())   # targets: plain
            loss.backward()
    """
    try:
        make = _PLANS[name]
    except KeyError:
        raise KeyError(f"no plan named {name!r}; the zoo has {list_plans()}") from None
    if name == "auto":  # the only plan that runs the model, and so may need its inputs
        return make(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                    expert_parallel=expert_parallel, example_inputs=example_inputs)
    if example_inputs is not None:
        raise ValueError(f'get_plan({name!r}): example_inputs is for get_plan("auto", ...), which traces the model')
    if name in MOE_FAMILIES:
        return make(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                    expert_parallel=expert_parallel)
    if expert_parallel:
        raise ValueError(f"get_plan({name!r}, expert_parallel=True): {name!r} models have no experts to divide over "
                         f"an 'EP' dim; the zoo's MoE plans are {sorted(MOE_FAMILIES)} (without experts, make the "
                         "'EP' ranks data parallel)")
    return make(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
