"""``get_plan("auto")`` works out the inputs of models that do not take token ids alone (issue #39):
from the forward's argument names and sizes on the config or the first module, trying the next guess
where one fails. One process, no ranks: :func:`guess_inputs` and :func:`derive`'s trace."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from ndweave.dmodule.infer import derive, guess_inputs
from ndweave.dmodule.infer.inputs import guesses

transformers = pytest.importorskip("transformers")

__all__: list[str] = []


def _traced(model: nn.Module) -> list[tuple[int, ...]]:
    """The shapes :func:`derive` traced ``model`` with (a plan came out of it), in call order."""
    d = derive(model)
    assert d.trace is not None and d.trace.ops
    return [tuple(d.trace.values[v].shape) for v in d.trace.inputs]


def _named(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The first guess, argument name -> shape (a positional one under its parameter's name)."""
    args, kwargs = guess_inputs(model)
    names = list(inspect.signature(model.forward).parameters)
    return {**{names[i]: tuple(a.shape) for i, a in enumerate(args)},
            **{k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}}


def test_a_decoder_lm_still_gets_its_ids_positionally():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    args, kwargs = guess_inputs(transformers.LlamaForCausalLM(config))
    assert [(tuple(a.shape), a.dtype) for a in args] == [((2, 8), torch.long)] and kwargs == {}


def test_a_vit_classifier_gets_pixel_values_of_its_configs_size():
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    image_size=48, patch_size=8, num_channels=3, num_labels=3)
    model = transformers.ViTForImageClassification(config)
    assert _named(model) == {"pixel_values": (2, 3, 48, 48)}
    assert _traced(model) == [(2, 3, 48, 48)]


def test_whisper_gets_its_mel_frames_and_decoder_ids():
    # (its encoder takes exactly twice max_source_positions frames; its decoder needs ids of its own)
    config = transformers.WhisperConfig(vocab_size=64, num_mel_bins=16, d_model=32, encoder_layers=1,
                                        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                                        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1)
    config._attn_implementation = "eager"
    assert _traced(transformers.WhisperForConditionalGeneration(config)) == [(2, 16, 32), (2, 8)]


def test_t5_gets_decoder_ids_once_its_ids_alone_fail():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    assert _named(model) == {"input_ids": (2, 8)}  # (the first guess: T5's forward fails on it ...)
    assert _traced(model) == [(2, 8), (2, 8)]  # (... and the next, with decoder ids, runs)


def test_clip_gets_pixel_values_beside_its_ids():
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 16}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    model = transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    assert _traced(model) == [(2, 8), (2, 3, 32, 32)]  # (the vision config's size, not the text's)


def test_a_diffusers_dit_gets_latents_timestep_and_labels():
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=1,
                                            sample_size=8, patch_size=2, norm_num_groups=4)
    assert _traced(model) == [(2, 4, 8, 8), (2,), (2,)]  # hidden_states, timestep, class_labels


class _EncoderDecoder(nn.Module):
    """Like an HF encoder-decoder, without transformers: decoder ids optional but needed."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        if decoder_input_ids is None:
            raise ValueError("decoder_input_ids are needed")
        return self.proj(self.embed(input_ids)) + self.embed(decoder_input_ids)


def test_the_next_guess_is_tried_where_one_fails():
    described = [g.describe() for g in guesses(_EncoderDecoder())]
    assert described == ["input_ids (2, 8) long", "input_ids (2, 8) long, decoder_input_ids (2, 8) long"]
    assert _traced(_EncoderDecoder()) == [(2, 8), (2, 8)]


def test_when_every_guess_fails_the_error_names_each():
    class Picky(_EncoderDecoder):
        def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
            raise RuntimeError("no")

    with pytest.raises(ValueError, match=r"failed on each of 2 guessed inputs: \[0\] input_ids \(2, 8\) long "
                                         r"\(on meta: RuntimeError: no; on fake: RuntimeError: no\); \[1\] "
                                         r"input_ids \(2, 8\) long, decoder_input_ids \(2, 8\) long"):
        derive(Picky())


def test_a_model_nothing_can_be_guessed_for_says_what_was_read():
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(self.norm(x))

    assert guesses(Normed()) == []
    with pytest.raises(ValueError, match=r"cannot guess the inputs of Normed \(its forward requires x \(x: no size "
                                         r"known for it\), main_input_name None, no nn.Embedding, and its first "
                                         r"module with parameters is a LayerNorm .*pass example_inputs="):
        derive(Normed())
