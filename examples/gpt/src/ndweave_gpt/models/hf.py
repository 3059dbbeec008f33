"""The GPT job's transformers models (``--model hf:<model_type>``): their config, their plan, and
where their pretrained weights come from. transformers is an optional dependency of the job only.

    config = hf_config("llama", "tiny", block_size=64)                 # or a config.json, or --init-from
    model = AutoModelForCausalLM.from_config(config)                    # in train.build_model
    plan_name("llama")                                                  # "hf_llama": the zoo's, else "auto"

The data is bytes (vocabulary 256), so any model whose vocabulary holds the ids 0..255 trains on it;
``tiny`` and ``small`` give it exactly 256.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["EXPERT_FIELDS", "PRESETS", "config_from_json", "config_json", "experts_of", "hf_config", "plan_name",
           "tied_aliases"]

#: ``--config`` presets: sizes every decoder's config understands (a config ignores the fields it has
#: no use for; GPT-2-style configs map them to their own names)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rotary_dim=16),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, rotary_dim=32),
}
#: what every preset sets besides its sizes: the byte vocabulary, no dropout, no KV cache (the
#: pipeline traces one forward), no pad id (a pad row would be zeroed at init)
COMMON = dict(vocab_size=256, pad_token_id=None, bos_token_id=1, eos_token_id=2, attention_dropout=0.0,
              hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
#: the config field holding a MoE family's number of routed experts (the zoo's MOE_FAMILIES fields)
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
#: model types with a hand-written plan in the zoo (MoE families: experts over EP)
ZOO = {"llama": "hf_llama", "gpt2": "hf_gpt2", "mixtral": "hf_mixtral", "qwen2_moe": "hf_qwen2_moe",
       "qwen3_moe": "hf_qwen3_moe", "deepseek_v3": "hf_deepseek_v3"}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise SystemExit("error: --model hf:... needs the transformers package: `pip install transformers`") from None
    return transformers


def hf_config(model_type: str | None, config: str, *, block_size: int, moe_experts: int = 0, moe_top_k: int = 2,
              init_from: str | None = None, bytes_data: bool = True, vocab_size: int = 0) -> Any:
    """The transformers config of the job's model: the one in ``init_from`` (a checkpoint folder),
    else the file ``config`` (a ``config.json``), else preset ``config`` (``tiny`` / ``small``) of
    ``model_type``, its vocabulary ``vocab_size`` ids where given (a tokenizer's; else the 256 bytes). Refused, naming the fix: another model type than ``init_from``'s, a vocabulary
    without the 256 byte ids (``bytes_data``: the job reads bytes, no tokenizer), positions shorter than
    ``--block-size``."""
    transformers = _transformers()
    source = Path(init_from) / "config.json" if init_from else Path(config) if config not in PRESETS else None
    if source is not None:
        if not source.is_file():
            raise SystemExit(f"error: {source} does not exist: --init-from takes a transformers checkpoint folder "
                             "(config.json + model.safetensors), --config a config.json, tiny or small")
        values = json.loads(source.read_text())
        found = values.get("model_type")
        if model_type is not None and found != model_type:
            raise SystemExit(f"error: {source} is a {found!r} model, not hf:{model_type}: pass --model hf:{found}")
        cfg = transformers.AutoConfig.for_model(**values)
    else:
        sizes = {**PRESETS[config], **COMMON, "max_position_embeddings": block_size,
                 **({"vocab_size": vocab_size} if vocab_size else {})}
        if moe_experts:
            sizes.update(dict.fromkeys(EXPERT_FIELDS, moe_experts), num_experts_per_tok=moe_top_k)
        cfg = transformers.AutoConfig.for_model(model_type, **_settable(model_type, sizes))
    cfg._attn_implementation = "sdpa"
    if experts_of(cfg):
        # shapes that do not depend on the routing: the pipeline traces the model on meta, where the
        # eager loop's nonzero has no value and the default grouped mm takes only bf16
        cfg._experts_implementation = "batched_mm"
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    vocab, positions = cfg.vocab_size, getattr(cfg, "max_position_embeddings", None)
    if bytes_data and vocab < 256:
        raise SystemExit(f"error: the model's vocabulary has {vocab} ids; the job's data is bytes (ids 0..255): "
                         "use a model with a vocabulary of 256 or more")
    if positions is not None and positions < block_size:
        raise SystemExit(f"error: --block-size {block_size} is longer than the model's {positions} positions "
                         f"(max_position_embeddings): pass --block-size {positions} or less")
    return cfg


def _settable(model_type: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` less the fields ``model_type``'s config class computes itself (read-only properties,
    e.g. Falcon's head_dim)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise SystemExit(f"error: hf:{model_type}: transformers has no model type {model_type!r} "
                         "(e.g. hf:llama, hf:qwen2, hf:mixtral, hf:gpt2)")
    cls = CONFIG_MAPPING[model_type]
    return {k: v for k, v in values.items() if getattr(getattr(cls, k, None), "fset", True) is not None}


def config_json(config: Any, dtype: torch.dtype) -> str:
    """``config`` as JSON, saying the weights are in ``dtype`` (what from_pretrained loads them as)."""
    values = config.to_dict()
    values["dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(values)


def config_from_json(text: str) -> Any:
    """The transformers config :func:`config_json` wrote."""
    values = json.loads(text)
    return _transformers().AutoConfig.for_model(values.pop("model_type"), **values)


def experts_of(config: Any) -> int:
    """Routed experts per MoE layer of a transformers config (0: a dense model)."""
    return next((getattr(config, f) for f in EXPERT_FIELDS if getattr(config, f, None)), 0)


def plan_name(model_type: str) -> str:
    """The zoo's plan for the family, else ``"auto"`` (derived from the model)."""
    return ZOO.get(model_type, "auto")


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{name: source}`` for each parameter tied to an earlier one (an LM head sharing the
    embedding): transformers stores a tied weight once, under the source's name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases
