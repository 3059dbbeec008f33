"""Real transformers models of several kinds, built from tiny configs, and their batches: encoder
classifiers (input ids and an attention mask), a vision classifier (pixel values), encoder-decoders
(input ids and decoder input ids), CLIP (input ids and pixel values), diffusers' DiT (latents, timesteps
and class labels), LoRA adapters on a Llama, for the pipeline's parity tests
with several inputs given as keyword arguments (``engine({"input_ids": ..., ...}, targets)``)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ndweave.pipeline import PipeEngine, construct_pipeline_stage

VOCAB, SEQ, LABELS, IMAGE = 40, 6, 3, 8
#: a tiny transformer: 2 layers of width 16 (float64, eager attention: the parity is exact)
TINY = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
        "vocab_size": VOCAB, "max_position_embeddings": 32, "num_labels": LABELS, "attn_implementation": "eager",
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(**TINY))


def roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    return RobertaForSequenceClassification(RobertaConfig(**TINY, pad_token_id=0))


def esm() -> nn.Module:
    from transformers import EsmConfig, EsmForSequenceClassification

    return EsmForSequenceClassification(EsmConfig(**TINY, pad_token_id=0, mask_token_id=1))


def deberta_v2() -> nn.Module:
    """Relative attention: ``encoder.rel_embeddings`` is read by every layer, on both stages."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    return DebertaV2ForSequenceClassification(DebertaV2Config(**TINY, relative_attention=True, position_buckets=8,
                                                              pos_att_type=["c2p", "p2c"], pooler_dropout=0.0))


def modernbert() -> nn.Module:
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    return ModernBertForSequenceClassification(ModernBertConfig(
        **{k: v for k, v in TINY.items() if "dropout" not in k}, pad_token_id=0, global_attn_every_n_layers=2,
        local_attention=4))


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        **{k: v for k, v in TINY.items() if k not in ("vocab_size", "max_position_embeddings")}, image_size=IMAGE,
        patch_size=4, num_channels=3))


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                               num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                                               decoder_start_token_id=0, attn_implementation="eager"))


def bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, attn_implementation="eager"))


def clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "projection_dim": 8}
    text = {**tower, "vocab_size": VOCAB, "max_position_embeddings": 32}
    vision = {**tower, "image_size": IMAGE, "patch_size": 4}
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8,
                                attn_implementation="eager"))


def lora_llama() -> nn.Module:
    """A Llama with PEFT LoRA adapters on its attention (only the adapters train)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        attn_implementation="eager"))
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                           init_lora_weights=False))  # (B != 0: the base's grads reach A too)


def dit() -> nn.Module:
    """diffusers' DiT: noisy latents, a timestep and a class label per sample, conditioning every block."""
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                 num_layers=2, sample_size=IMAGE, patch_size=2, norm_num_groups=4)


def _ids(g: torch.Generator, batch: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, SEQ), generator=g)


def _mask(batch: int) -> torch.Tensor:
    """Every other sample padded after its first 4 tokens (the mask's effect is part of the parity)."""
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[1::2, 4:] = 0
    return mask


def text_batch(g: torch.Generator, batch: int):
    return {"input_ids": _ids(g, batch), "attention_mask": _mask(batch)}, torch.randint(0, LABELS, (batch,), generator=g)


def image_batch(g: torch.Generator, batch: int):
    return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=g)}, \
        torch.randint(0, LABELS, (batch,), generator=g)


def lm_batch(g: torch.Generator, batch: int):
    return {"input_ids": _ids(g, batch)}, _ids(g, batch)


def seq2seq_batch(g: torch.Generator, batch: int):
    return ({"input_ids": _ids(g, batch), "attention_mask": _mask(batch), "decoder_input_ids": _ids(g, batch)},
            _ids(g, batch))


def clip_batch(g: torch.Generator, batch: int):
    return ({"input_ids": _ids(g, batch), "pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=g)},
            torch.arange(batch))


def diffusion_batch(g: torch.Generator, batch: int):
    """Latents (4 channels), timesteps and class labels; the target: the noise to predict."""
    return ({"hidden_states": torch.randn(batch, 4, IMAGE, IMAGE, generator=g),
             "timestep": torch.randint(0, 1000, (batch,), generator=g),
             "class_labels": torch.randint(0, 1000, (batch,), generator=g)},
            torch.randn(batch, 4, IMAGE, IMAGE, generator=g))


def first_output(output) -> torch.Tensor:
    """The logits: the pipeline's last stage hands the model output's first tensor to the loss (a
    ``ModelOutput``'s first field that is set), one process the whole output."""
    return output if isinstance(output, torch.Tensor) else output[0]


def classifier_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(first_output(output), targets)


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(first_output(output).flatten(0, 1), targets.flatten())


def diffusion_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(first_output(output), targets)


def clip_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """``logits_per_image`` of a micro-batch against its own pairs (targets: each sample's row)."""
    logits = first_output(output)
    return F.cross_entropy(logits, torch.arange(logits.shape[0]))


#: name -> (model, batch, loss)
KINDS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable]] = {
    "bert": (bert, text_batch, classifier_loss),
    "roberta": (roberta, text_batch, classifier_loss),
    "esm": (esm, text_batch, classifier_loss),
    "deberta_v2": (deberta_v2, text_batch, classifier_loss),
    "modernbert": (modernbert, text_batch, classifier_loss),
    "vit": (vit, image_batch, classifier_loss),
    "t5": (t5, seq2seq_batch, lm_loss),
    "bart": (bart, seq2seq_batch, lm_loss),
    "clip": (clip, clip_batch, clip_loss),
    "lora_llama": (lora_llama, lm_batch, lm_loss),
    "dit": (dit, diffusion_batch, diffusion_loss),
}


def kind_run(name: str, steps: int = 2, batch: int = 8):
    """float64: the model (eval mode, no dropout), its batches and the loss."""
    build, make_batch, loss = KINDS[name]
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = build().eval()
    g = torch.Generator().manual_seed(0)
    return model, [make_batch(g, batch) for _ in range(steps)], loss


def train_one_process_kwargs(model: nn.Module, data, loss, lr: float = 0.05, micro_batches: int = 1):
    """One process, the usual loop with keyword inputs (``model(**inputs)``): per step the loss and
    {fqn: grad}; then the final {fqn: param}. ``micro_batches``: the mean of the loss over that many
    equal parts (a contrastive loss, over each part's own pairs, is what a pipeline computes)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], []
    for inputs, targets in data:
        opt.zero_grad()
        parts = [{k: v.chunk(micro_batches)[i] for k, v in inputs.items()} for i in range(micro_batches)]
        value = sum(loss(model(**part), y) / micro_batches for part, y in zip(parts, targets.chunk(micro_batches)))
        value.backward()
        losses.append(value.detach())
        grads.append(_grads(model))
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


#: keyword values fixed in the trace: an encoder-decoder would build a cache object (no tensor) to
#: hand its layers, which cannot cross a stage; training needs none
TRACE_KEYWORDS = {name: {"use_cache": False} for name in ("t5", "bart", "lora_llama")}


def train_pipeline_kwargs(model: nn.Module, plan, mesh, data, loss, lr: float = 0.05, fixed: dict | None = None):
    """The same loop through ``PipeEngine``, traced on one micro-batch of the first batch's inputs
    (a dict: keyword arguments; ``fixed``: keyword values that are no tensors, for the trace); this
    rank's losses, grads and final parameters."""
    inputs, _ = data[0]
    micro = len(next(iter(inputs.values()))) // plan.num_microbatches
    example = {**{k: v[:micro] for k, v in inputs.items()}, **(fixed or {})}
    module = construct_pipeline_stage(copy.deepcopy(model), plan, mesh, example_inputs=example)
    engine = PipeEngine(module, mesh, loss, plan)
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    losses, grads = [], []
    for inputs, targets in data:
        opt.zero_grad()
        losses.append(engine(inputs, targets))
        grads.append(_grads(module))
        opt.step()
    engine.close()
    return losses, grads, {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's grad by FQN, zeros where none reached it (a padding row's embedding)."""
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in module.named_parameters(remove_duplicate=False)}
