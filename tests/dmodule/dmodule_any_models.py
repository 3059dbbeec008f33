"""Tiny models beyond decoder LMs for the automatic plan's tests, and the parity check they run.

A case is ``"<registry>/<name>"``: a transformers registry's model type (``masked_lm/bert``,
``seq_cls/deberta``, ``image_cls/vit``, ``seq2seq/t5``, ``speech_seq2seq/whisper``,
``audio_cls/wav2vec2``, ``contrastive/clip``), one of diffusers' transformers (``diffusion/dit``,
``sd3``, ``flux``, ``pixart``) or a PEFT adapter on a tiny decoder (``peft/llama_lora``, ``..._dora``).

``build_any(case)`` builds it from a tiny config made generically from the config class's defaults
(the sizes of ``TINY`` that the config has, stage lists shrunk, sub-configs made tiny the same way;
eager attention); ``batch_candidates(case, model, step)`` the inputs to try, by the model's input
kind (``main_input_name``: ids, pixel_values, input_features, input_values; decoder ids for an
encoder-decoder), the first that runs on one process is the case's; ``loss_of(case, out, target)``
the loss computed outside the model against plain targets (a model of the seq2seq / speech registries
that is a decoder LM with an audio tower, Granite Speech say, runs on its ids alone: its tower gets no
gradient). ``check_any_parity(case)`` parallelizes a
copy with ``get_plan("auto", model)`` and nothing else and compares the output, the loss, every
gradient and the parameters after an SGD step with one process, in float64.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ndweave.mesh.testing import STRICT_DTYPE, Tolerance, assert_close

BATCH, SEQ, DECODER_SEQ, VOCAB, LABELS = 2, 16, 8, 128, 3
#: sizes a tiny config takes, where the config class has an attribute of that name and type (int);
#: the names the families use for the same size (hidden_size / d_model / dim ...)
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64, "embedding_size": 64, "d_model": 64,
        "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
        "d_ff": 128, "d_kv": 16, "head_dim": 16, "dim": 64, "hidden_dim": 128, "n_layers": 2, "n_heads": 4,
        "projection_dim": 32, "attention_window": 8, "window_size": 4, "image_size": 32, "patch_size": 8,
        "max_source_positions": 32, "max_target_positions": 64, "num_conv_pos_embeddings": 16, "hidden_act_dim": 64,
        "encoder_hidden_size": 64, "text_hidden_size": 64, "vision_hidden_size": 64, "output_hidden_size": 64,
        "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
#: per-stage width lists (convolutional and hierarchical vision models), divided by WIDTH_DIVISOR
STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "embed_dim", "hidden_dims", "neck_hidden_sizes", "conv_dim",
                "dims", "channels", "stage_channels")
WIDTH_DIVISOR = 8
DIFFUSERS = {  # name -> (class name, tiny kwargs)
    "dit": ("DiTTransformer2DModel", {"num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4,
                                      "num_layers": 2, "sample_size": 8, "patch_size": 2, "norm_num_groups": 4}),
    "sd3": ("SD3Transformer2DModel", {"sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2,
                                      "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                                      "caption_projection_dim": 32, "pooled_projection_dim": 32, "out_channels": 4,
                                      "pos_embed_max_size": 16}),
    "flux": ("FluxTransformer2DModel", {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
                                        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                                        "pooled_projection_dim": 32, "axes_dims_rope": (4, 6, 6)}),
    "pixart": ("PixArtTransformer2DModel", {"num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4,
                                            "out_channels": 8, "num_layers": 2, "cross_attention_dim": 32,
                                            "sample_size": 8, "patch_size": 2, "caption_channels": 32,
                                            "norm_num_groups": 4, "use_additional_conditions": False}),
}
#: per model type: what its tiny config needs besides the generic sizes (None: leave the default)
ARCHS: dict[str, dict] = {
    "funnel": {"block_sizes": [1, 1], "num_hidden_layers": None},  # (its layers are counted per block)
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 4], "lsh_attn_chunk_length": 8,
                 "local_attn_chunk_length": 8},  # (the axial positions factor the sequence and the width)
    "esm": {"pad_token_id": 1, "mask_token_id": 2},  # (its defaults are None)
    "t5": {"decoder_start_token_id": 0}, "mt5": {"decoder_start_token_id": 0}, "umt5": {"decoder_start_token_id": 0},
    "prophetnet": {"num_hidden_layers": None, "num_encoder_layers": 2, "num_decoder_layers": 2},
    "luke": {"entity_vocab_size": 16, "entity_emb_size": 32},
    "roc_bert": {"pronunciation_vocab_size": 16, "shape_vocab_size": 16, "pronunciation_embed_dim": 16,
                 "shape_embed_dim": 16},
}
PEFT_FAMILIES = ("llama", "qwen2", "gpt2")
CONTRASTIVE = ("clip", "siglip")


def registries() -> dict[str, list[str]]:
    """Registry id -> its model types (names): transformers' registries, CLIP / SigLIP, diffusers,
    PEFT. Sequence classification leaves out the decoder LMs test_dmodule_auto_archs covers."""
    from transformers.models.auto import modeling_auto as m

    causal = set(m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return {
        "masked_lm": sorted(m.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        "seq_cls": sorted(set(m.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES) - causal),
        "image_cls": sorted(m.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES),
        "seq2seq": sorted(m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        "speech_seq2seq": sorted(m.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES),
        "audio_cls": sorted(m.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES),
        "contrastive": list(CONTRASTIVE),
        "diffusion": list(DIFFUSERS),
        "peft": [f"{family}_{kind}" for family in PEFT_FAMILIES for kind in ("lora", "dora")],
    }


def _auto_class(registry: str):
    import transformers

    return {"masked_lm": transformers.AutoModelForMaskedLM, "seq_cls": transformers.AutoModelForSequenceClassification,
            "image_cls": transformers.AutoModelForImageClassification, "seq2seq": transformers.AutoModelForSeq2SeqLM,
            "speech_seq2seq": transformers.AutoModelForSpeechSeq2Seq,
            "audio_cls": transformers.AutoModelForAudioClassification, "contrastive": transformers.AutoModel}[registry]


def _tiny_kwargs(config_class) -> dict:
    """The tiny sizes ``config_class`` takes, from its defaults: TINY's ints where it has an int of that
    name; per-stage depths 1 and widths divided; ids past the tiny vocabulary 0; sub-configs likewise."""
    default = config_class()
    kwargs = {}
    for key, value in TINY.items():
        current = getattr(default, key, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > 0:
            kwargs[key] = min(value, current) if key not in ("vocab_size",) else value
        elif key == "vocab_size" and hasattr(default, key):  # (ESM's default is None)
            kwargs[key] = value
    depths = getattr(default, "depths", None)
    if isinstance(depths, (list, tuple)) and all(isinstance(d, int) for d in depths):
        kwargs["depths"] = [1] * len(depths)
    for key in STAGE_WIDTHS:
        current = getattr(default, key, None)
        if isinstance(current, (list, tuple)) and current and all(isinstance(w, int) for w in current):
            kwargs[key] = [max(8, w // WIDTH_DIVISOR) for w in current]
        elif isinstance(current, int) and not isinstance(current, bool) and key in ("embed_dim",) and depths:
            kwargs[key] = max(8, current // WIDTH_DIVISOR)
    for key in dir(default):
        if key.endswith("_token_id") and not key.startswith("_"):
            current = getattr(default, key, None)
            if isinstance(current, int) and current >= VOCAB:
                kwargs[key] = 0
    if getattr(default, "num_labels", None) is not None:
        kwargs["num_labels"] = LABELS
    for name, sub_class in getattr(config_class, "sub_configs", {}).items():
        held = getattr(default, name, None)
        sub_class = type(held) if hasattr(held, "to_dict") else sub_class  # (an AutoConfig sub-config: its default's)
        try:
            kwargs[name] = {"model_type": getattr(sub_class, "model_type", ""), **_tiny_kwargs(sub_class)}
        except Exception:  # noqa: BLE001, S110 (a sub-config without defaults keeps its own)
            pass
    return kwargs


def tiny_config(registry: str, arch: str):
    """transformers' config of model type ``arch``, tiny, eager attention."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[arch]
    kwargs = {**_tiny_kwargs(config_class), **ARCHS.get(arch, {})}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    config = config_class(**kwargs)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    for sub in getattr(config_class, "sub_configs", {}):
        sub_config = getattr(config, sub, None)
        if sub_config is not None and hasattr(sub_config, "_attn_implementation"):
            sub_config._attn_implementation = "eager"
    return config


def build_any(case: str) -> nn.Module:
    """The tiny model of ``case`` (``"<registry>/<name>"``) in the default dtype."""
    registry, name = case.split("/")
    if registry == "diffusion":
        import diffusers

        class_name, kwargs = DIFFUSERS[name]
        return getattr(diffusers, class_name)(**kwargs)
    if registry == "peft":
        from peft import LoraConfig, get_peft_model

        try:
            from dmodule_auto_models import build_hf
        except ImportError:  # (imported from another test folder: tests/ is on the path, not tests/dmodule)
            from dmodule.dmodule_auto_models import build_hf

        family, kind = name.rsplit("_", 1)
        # init_lora_weights=False: B random (not zero), so the adapters' gradients and outputs are not trivially zero
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                            use_dora=kind == "dora")
        return get_peft_model(build_hf(family), config)
    return _auto_class(registry).from_config(tiny_config(registry, name))


def _size(config, key, default=None):
    for holder in (config, getattr(config, "vision_config", None), getattr(config, "encoder", None)):
        value = getattr(holder, key, None) if holder is not None else None
        if value is not None:
            return value
    return default


def batch_candidates(case: str, model: nn.Module, step: int) -> list[tuple[dict, torch.Tensor]]:
    """The (inputs, target) pairs to try for ``case``, most likely first; the same ``step`` gives the same
    batch. The target: class labels, token targets, or a tensor of the output's shape (diffusion)."""
    registry, name = case.split("/")
    g = torch.Generator().manual_seed(1000 + step)
    dtype = torch.get_default_dtype()
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, LABELS, (BATCH,), generator=g)
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if registry == "seq_cls" and isinstance(eos, int):  # (T5's classifier reads the sentence at its eos)
        ids[:, -1] = eos
    if registry == "peft":
        return [({"input_ids": ids}, torch.roll(ids, -1, dims=1))]
    if registry == "diffusion":
        t = torch.randint(0, 1000, (BATCH,), generator=g)
        kwargs = DIFFUSERS[name][1]
        if name == "flux":
            side = 4
            positions = torch.meshgrid(torch.arange(1), torch.arange(side), torch.arange(side), indexing="ij")
            inputs = {"hidden_states": torch.randn(BATCH, side * side, kwargs["in_channels"], generator=g),
                      "encoder_hidden_states": torch.randn(BATCH, 8, kwargs["joint_attention_dim"], generator=g),
                      "pooled_projections": torch.randn(BATCH, kwargs["pooled_projection_dim"], generator=g),
                      "timestep": t.to(dtype) / 1000,
                      "img_ids": torch.stack(positions, -1).reshape(-1, 3).to(dtype),  # (frame, row, column)
                      "txt_ids": torch.zeros(8, 3)}
            target = torch.randn(BATCH, side * side, kwargs["in_channels"], generator=g)
            return [(inputs, target)]
        latents = torch.randn(BATCH, kwargs["in_channels"], 8, 8, generator=g)
        out_channels = kwargs.get("out_channels") or kwargs["in_channels"]
        target = torch.randn(BATCH, out_channels, 8, 8, generator=g)
        inputs = {"hidden_states": latents, "timestep": t}
        if name == "dit":
            inputs["class_labels"] = torch.randint(0, 1000, (BATCH,), generator=g)
        if name == "sd3":
            inputs.update(encoder_hidden_states=torch.randn(BATCH, 8, kwargs["joint_attention_dim"], generator=g),
                          pooled_projections=torch.randn(BATCH, kwargs["pooled_projection_dim"], generator=g))
        if name == "pixart":
            inputs.update(encoder_hidden_states=torch.randn(BATCH, 8, kwargs["caption_channels"], generator=g),
                          added_cond_kwargs={"resolution": None, "aspect_ratio": None})
        return [(inputs, target)]
    config = model.config
    if registry == "contrastive":
        side = _size(config.vision_config, "image_size", 32)
        pixels = torch.randn(BATCH, _size(config.vision_config, "num_channels", 3), side, side, generator=g)
        return [({"input_ids": ids, "pixel_values": pixels}, torch.arange(BATCH))]
    main = getattr(model, "main_input_name", "input_ids")
    firsts: list[dict] = []
    if main == "pixel_values":
        side = _size(config, "image_size", 32)
        side = side if isinstance(side, int) else side[0]
        firsts.append({main: torch.randn(BATCH, _size(config, "num_channels", 3), side, side, generator=g)})
    elif main == "input_features":
        mels = _size(config, "num_mel_bins")
        frames = 2 * _size(config, "max_source_positions", 32)
        if mels:
            firsts.append({main: torch.randn(BATCH, mels, frames, generator=g)})
        features = _size(config, "input_feat_per_channel") or _size(config, "feature_size") or mels or 80
        features *= _size(config, "input_channels", 1)
        firsts.append({main: torch.randn(BATCH, frames, features, generator=g)})
        if mels:
            firsts.append({main: torch.randn(BATCH, frames, mels, generator=g)})
    elif main == "input_values":
        firsts.append({main: torch.randn(BATCH, 4000, generator=g)})
        mels = _size(config, "num_mel_bins", 128)
        frames = _size(config, "max_length", 64)
        firsts.append({main: torch.randn(BATCH, min(frames, 128), mels, generator=g)})
    else:
        firsts.append({"input_ids": ids})
    candidates = []
    for first in firsts:
        if registry in ("seq2seq", "speech_seq2seq") and getattr(config, "is_encoder_decoder", False):
            decoder_ids = torch.randint(3, VOCAB, (BATCH, DECODER_SEQ), generator=g)
            candidates.append(({**first, "decoder_input_ids": decoder_ids}, torch.roll(decoder_ids, -1, dims=1)))
        elif registry in ("seq_cls", "image_cls", "audio_cls"):
            candidates.append((first, labels))
        else:  # masked LM, a decoder-only model in the seq2seq registries: token targets of the ids' shape
            candidates.append((first, torch.randint(3, VOCAB, ids.shape, generator=g)))
    return candidates


def output_of(case: str, out) -> torch.Tensor:
    """The tensor the loss is computed from."""
    registry = case.split("/")[0]
    if registry == "contrastive":
        return out.logits_per_image
    if registry == "diffusion":
        return out.sample
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out[0]


def loss_of(case: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if case.startswith("diffusion/"):
        return F.mse_loss(output, target)
    if output.dim() == 2:  # classes (classifier, contrastive logits)
        return F.cross_entropy(output, target)
    return F.cross_entropy(output.flatten(0, -2), target.flatten()[: output.flatten(0, -2).shape[0]])


def run_case(case: str, model: nn.Module, inputs: dict, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    output = output_of(case, model(**inputs))
    return output, loss_of(case, output, target)


def first_batch_that_runs(case: str, model: nn.Module) -> int:
    """The index in ``batch_candidates`` of the first batch ``model`` trains on (forward, loss and
    backward, in eval mode) on one process; raises the first candidate's error where none does."""
    first_error = None
    for index, (inputs, target) in enumerate(batch_candidates(case, model, 0)):
        try:
            run_case(case, model, inputs, target)[1].backward()
            model.zero_grad()
            return index
        except Exception as error:  # noqa: BLE001
            first_error = first_error or error
    raise first_error


def check_any_parity(case: str, *, sequence_parallel: bool = False, steps: int = 1, tol: Tolerance,
                     candidate: int = 0, example_inputs: bool = False) -> None:
    """Run on every rank: ``get_plan("auto", model)`` on a 1-D TP mesh matches one process (the output,
    the loss, every gradient, the parameters after ``steps`` SGD steps) within ``tol``. ``example_inputs``:
    hand "auto" the batch's shapes (for triage: what lies behind "cannot guess the inputs")."""
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference = build_any(case).eval()  # eval: no dropout, whatever the config calls it
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("TP",))
    example = ((), batch_candidates(case, reference, 0)[candidate][0]) if example_inputs else None
    model = parallelize_module(model, mesh, get_plan("auto", model, sequence_parallel=sequence_parallel,
                                                     example_inputs=example))
    ref_params, params = dict(reference.named_parameters()), dict(model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9, foreach=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=False)
    for step in range(steps):
        inputs, target = batch_candidates(case, reference, step)[candidate]
        ref_out, ref_loss = run_case(case, reference, inputs, target)
        out, loss = run_case(case, model, inputs, target)
        assert_close(out, ref_out, name=f"{case} step {step} output", tol=tol)
        assert_close(loss, ref_loss, name=f"{case} step {step} loss", tol=tol)
        ref_loss.backward()
        loss.backward()
        model.finish_grad_sync()
        for fqn, ref_p in ref_params.items():
            if ref_p.grad is None:  # (a parameter the loss does not reach, a frozen base weight under PEFT)
                assert params[fqn].grad is None, f"{case} step {step}: {fqn} got a gradient one process does not"
            else:
                assert params[fqn].grad is not None, f"{case} step {step}: {fqn} got no gradient, one process does"
                assert_close(params[fqn].grad, ref_p.grad, name=f"{case} step {step} {fqn}.grad", tol=tol)
        for optimizer in (ref_opt, opt):
            optimizer.step()
            optimizer.zero_grad()
    for fqn, ref_p in ref_params.items():
        assert_close(params[fqn], ref_p, name=f"{case} {fqn} after {steps} steps", tol=tol)
