"""The inputs ``get_plan("auto")`` traces a model with when it is given no ``example_inputs``.

Only shapes and dtypes matter (the trace runs on meta or fake tensors), so a guess is a set of
empty meta tensors. They are read off the model generically, never per model type:

- the forward's argument names: those it requires (no default) and HF's ``main_input_name``, each
  built from ``_ARGUMENTS``, a table keyed by argument name whose sizes come from config fields
  (``image_size``, ``num_mel_bins``, ``sample_size``, ``joint_attention_dim`` ...: the model's
  config or any of its sub-configs) or from the first module that would consume the input (a
  ``Conv2d``'s ``in_channels``, a ``Linear``'s ``in_features``);
- else, as before, token ids when the model holds an ``nn.Embedding``, or activations sized for its
  first module with parameters (``Linear``, ``Conv1d``, ``Conv2d``), passed positionally.

:func:`guesses` lists candidates, most likely first: the required and main inputs alone (a decoder
LM's ids ``(2, 8)``, as before), then with the companions the forward names (decoder ids,
diffusion's timestep and conditioning), then with the other main inputs it names too (CLIP's
``pixel_values`` beside its ``input_ids``); each with the alternative shapes its sizes allow (a
spectrogram channels-first or channels-last). The caller traces them in turn and keeps the first
that runs. Attention masks and other optional arguments are left out.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Guess", "guesses"]

BATCH, SEQ = 2, 8
#: when the config names no size (on meta a large input costs nothing): an image's side (ImageNet's
#: 224); a raw waveform's samples, a quarter second at 16 kHz, 12 frames out of wav2vec2's conv stack:
#: an even count, so that an encoder pooling frames in pairs (SEW) needs no padding (one second's 49
#: frames take a padding path, and the plan differs); a Conv1d's steps
_IMAGE_SIDE, _WAVEFORM, _STEPS = 224, 4000, 256
#: the most candidates tried: each failed one is a traced forward (twice, on meta and on fake)
_MOST = 12


@dataclass(frozen=True)
class Guess:
    """One set of inputs: ``model(*args, **kwargs)``, every tensor an empty meta one."""

    args: tuple
    kwargs: dict
    names: tuple[str, ...] = ()
    """The forward's names of ``args`` where known (the error names them)."""

    def describe(self) -> str:
        """``input_ids (2, 8) long, pixel_values (2, 3, 32, 32)``: what the error names as tried."""
        names = (*self.names, *(f"#{i}" for i in range(len(self.names), len(self.args))))
        parts = [_describe(name, a) for name, a in zip(names, self.args, strict=True)]
        return ", ".join(parts + [_describe(k, v) for k, v in self.kwargs.items()])


def _describe(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{name} {tuple(value.shape)}" + (" long" if value.dtype == torch.long else "")
    if isinstance(value, dict):
        return f"{name} {{{', '.join(_describe(k, v) for k, v in value.items())}}}"
    return f"{name} {value!r}"


class _Sizes:
    """Sizes of ``model`` read off its config (and sub-configs) and its modules."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.configs = list(_configs(getattr(model, "config", None)))
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    def get(self, *keys: str) -> Any:
        """The first of ``keys`` set (not ``None``) in the config, else in its sub-configs in order."""
        for config in self.configs:
            for key in keys:
                value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
                if value is not None and not isinstance(value, bool):
                    return value
        return None

    def flag(self, key: str) -> bool:
        return any(bool(c.get(key) if isinstance(c, dict) else getattr(c, key, False)) for c in self.configs)

    def first(self, *kinds: type[nn.Module]) -> nn.Module | None:
        """The first module of one of ``kinds`` (registration order: usually the input's consumer)."""
        return next((m for m in self.model.modules() if isinstance(m, kinds)), None)

    def ids(self) -> torch.Tensor:
        return torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")

    def floats(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device="meta")


def _configs(config: Any, depth: int = 0) -> Iterator[Any]:
    """``config`` then its sub-configs (CLIP's ``vision_config``, an encoder-decoder's ``encoder``):
    any attribute that is itself a config. Diffusers' config is a dict."""
    if config is None or depth > 2:
        return
    yield config
    values = config.values() if isinstance(config, dict) else vars(config).values()
    for value in values:
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # (a transformers config)
            yield from _configs(value, depth + 1)


def _side(value: Any) -> tuple[int, int] | None:
    """An image size as ``(height, width)``: configs write it ``32``, ``[32, 32]`` or ``(32, 32)``."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return value[0], value[1]
    return None


def _pixels(s: _Sizes) -> list[Any]:
    conv = s.first(nn.Conv2d)
    channels = s.get("num_channels", "in_channels") or (conv.in_channels if conv else 3)
    sides = [side for side in (_side(s.get("image_size", "img_size")), (_IMAGE_SIDE, _IMAGE_SIDE)) if side]
    return [s.floats(BATCH, channels, h, w) for h, w in dict.fromkeys(sides)]


def _frames(s: _Sizes) -> int:
    """Spectrogram frames: Whisper-style encoders take exactly twice their positions (a stride-2 conv)."""
    positions = s.get("max_source_positions")
    return 2 * positions if isinstance(positions, int) else 3000  # (else Whisper's 30 s)


def _features(s: _Sizes) -> list[Any]:
    """A spectrogram: channels-first ``(B, mel bins, frames)`` for an encoder opening with a Conv1d
    over mel bins, channels-last ``(B, frames, features)`` for one opening with a Linear (or with a
    Conv1d over time taking the features as channels): the config's sizes first, then the first
    consumer's."""
    frames, mels = _frames(s), s.get("num_mel_bins")
    per_channel = s.get("input_feat_per_channel")
    width = per_channel * (s.get("input_channels") or 1) if per_channel else s.get("feature_size") or mels
    conv, linear = s.first(nn.Conv1d), s.first(nn.Linear)
    shapes = [(BATCH, mels, frames) if mels else None, (BATCH, frames, width) if width else None,
              (BATCH, conv.in_channels, frames) if conv else None,
              (BATCH, frames, linear.in_features) if linear else None]
    return [s.floats(*shape) for shape in dict.fromkeys(shape for shape in shapes if shape)]


def _waveform(s: _Sizes) -> list[Any]:
    """A raw waveform ``(B, samples)`` (wav2vec2's family: a Conv1d over one channel), or where the
    config has mel bins, first a spectrogram ``(B, frames, mel bins)`` (the Audio Spectrogram Transformer)."""
    mels = s.get("num_mel_bins")
    spectrogram = [s.floats(BATCH, s.get("max_length") or _frames(s), mels)] if mels else []
    return [*spectrogram, s.floats(BATCH, _WAVEFORM)]


def _latents(s: _Sizes) -> list[Any]:
    """Diffusion latents: an image ``(B, C, H, W)`` where the config has a ``sample_size`` (DiT, SD3,
    PixArt), else a sequence ``(B, S, C)`` of packed latents (Flux) or of any module's activations;
    C is the config's ``in_channels``, else the first consumer's."""
    side = _side(s.get("sample_size"))
    conv, linear = s.first(nn.Conv2d), s.first(nn.Linear)
    channels = s.get("in_channels")
    shapes = [(BATCH, channels or (conv.in_channels if conv else None), *side) if side else None,
              (BATCH, SEQ, channels or (linear.in_features if linear else None))]
    return [s.floats(*shape) for shape in dict.fromkeys(shape for shape in shapes if shape and all(shape))]


def _width(*keys: str) -> Callable[[_Sizes], list[Any]]:
    """A text conditioning ``(B, S, width)``, its width the first of the config's ``keys`` set."""
    def make(s: _Sizes) -> list[Any]:
        width = s.get(*keys)
        return [s.floats(BATCH, SEQ, width)] if isinstance(width, int) else []
    return make


def _positions(s: _Sizes) -> list[Any]:
    """Rotary positions ``(S, axes)`` (Flux's ``img_ids`` / ``txt_ids``: one column per rope axis)."""
    axes = s.get("axes_dims_rope")
    return [s.floats(SEQ, len(axes) if isinstance(axes, (list, tuple)) else 3)]


#: argument name -> its alternatives (most likely first; none: left out). _MAIN: the model's own
#: input, one of which a forward takes; _COMPANIONS: what a forward takes beside it
_MAIN: dict[str, Callable[[_Sizes], list[Any]]] = {
    "input_ids": lambda s: [s.ids()],
    "pixel_values": _pixels,
    "input_values": _waveform,
    "input_features": _features,
    "hidden_states": _latents,
}
_COMPANIONS: dict[str, Callable[[_Sizes], list[Any]]] = {
    "decoder_input_ids": lambda s: [s.ids()],
    "timestep": lambda s: [s.floats(BATCH)],
    "class_labels": lambda s: [torch.zeros(BATCH, dtype=torch.long, device="meta")],
    "encoder_hidden_states": _width("joint_attention_dim", "caption_channels", "cross_attention_dim"),
    "pooled_projections": lambda s: [s.floats(BATCH, s.get("pooled_projection_dim"))]
    if s.get("pooled_projection_dim") else [],
    "img_ids": _positions,
    "txt_ids": _positions,
    # (guidance-distilled Flux only: the others take no guidance embedding)
    "guidance": lambda s: [s.floats(BATCH)] if s.flag("guidance_embeds") else [],
    # (PixArt's micro-conditions: read only where its config asks for them, but the dict must be there)
    "added_cond_kwargs": lambda s: [{"resolution": s.floats(BATCH, 2), "aspect_ratio": s.floats(BATCH, 1)}],
}
_ARGUMENTS = {**_MAIN, **_COMPANIONS}


def _main_input(model: nn.Module) -> str | None:
    """HF's ``main_input_name``; a composite naming its own (``inputs``) takes its encoder's."""
    name = getattr(model, "main_input_name", None)
    if isinstance(name, str) and name not in _ARGUMENTS:
        name = getattr(getattr(model, "encoder", None), "main_input_name", name)
    return name if isinstance(name, str) else None


def _named(model: nn.Module, s: _Sizes) -> Iterator[Guess]:
    """Guesses by argument name (see the module docstring), tier by tier."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = [n for n, p in parameters.items() if p.default is p.empty and p.kind in kinds]
    if any(n not in _ARGUMENTS for n in required):
        return  # (an argument the table cannot fill: the positional guesses below)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    main, names = _main_input(model), dict.fromkeys(required)
    own = getattr(model, "main_input_name", None)  # (the name it is passed under: ``inputs`` for a composite)
    if main in _ARGUMENTS and (own in parameters or takes_any):
        names[own] = None
    aliases = {own: main} if own != main else {}
    first = list(names)
    companions = first + [n for n in parameters if n in _COMPANIONS and n not in names]
    everything = companions + [n for n in parameters if n in _MAIN and n not in companions]
    for tier in dict.fromkeys(tuple(t) for t in (first, companions, everything) if t):
        yield from _combinations(parameters, tier, aliases, s)


def _combinations(parameters: Any, names: tuple[str, ...], aliases: dict[str, str], s: _Sizes) -> Iterator[Guess]:
    """Every combination of the alternatives of ``names`` (an argument with none is left out)."""
    options = {n: _ARGUMENTS[aliases.get(n, n)](s) for n in names}
    names = tuple(n for n in names if options[n])
    for values in itertools.product(*(options[n] for n in names)):
        yield _call(parameters, dict(zip(names, values, strict=True)))


def _call(parameters: Any, named: dict[str, Any]) -> Guess:
    """``named`` as a call: the leading ones that are the forward's first positional parameters
    passed positionally (as a user would: a decoder LM gets its ids as before), the rest by name."""
    args = {}
    for name, p in parameters.items():
        if name not in named or p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        args[name] = named.pop(name)
    return Guess(tuple(args.values()), named, tuple(args))


def _positional(s: _Sizes) -> Iterator[Guess]:
    """The guesses by module: token ids ``(2, 8)`` when the model holds an ``nn.Embedding`` (wherever
    it is registered: some register their head first), else activations for its first module with
    parameters: a Linear's ``(2, 8, in_features)``, a convolution's ``(2, in_channels, *sides)``."""
    try:
        name = next(iter(inspect.signature(s.model.forward).parameters), None)
    except (TypeError, ValueError):
        name = None
    names = (name,) if name and name not in ("args", "kwargs") else ()
    if s.first(nn.Embedding) is not None:
        yield Guess((s.ids(),), {}, names)
        return
    first = next((m for m in s.model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Linear):
        yield Guess((s.floats(BATCH, SEQ, first.in_features),), {}, names)
    elif isinstance(first, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        dims = len(first.kernel_size)
        sides = {1: (_STEPS,), 2: (_IMAGE_SIDE,) * 2, 3: (SEQ, _IMAGE_SIDE, _IMAGE_SIDE)}[dims]
        yield Guess((s.floats(BATCH, first.in_channels, *sides),), {}, names)


def guesses(model: nn.Module) -> list[Guess]:
    """The candidate inputs of ``model``, most likely first (see the module docstring); empty when
    nothing can be guessed."""
    s = _Sizes(model)
    seen: dict[str, Guess] = {}
    for guess in itertools.chain(_named(model, s), _positional(s)):
        seen.setdefault(guess.describe(), guess)  # (the same call by position or by name: once)
        if len(seen) == _MOST:
            break
    return list(seen.values())


def what_was_read(model: nn.Module) -> str:
    """For the error when nothing can be guessed: the forward's arguments and the first module."""
    try:
        names = [n for n, p in inspect.signature(model.forward).parameters.items() if p.default is p.empty
                 and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        names = []
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    unknown = [n for n in names if n not in _ARGUMENTS]
    return (f"its forward requires {', '.join(names) or 'no named argument'}"
            + (f" ({', '.join(unknown)}: no size known for {'it' if len(unknown) == 1 else 'them'})" if unknown else "")
            + f", main_input_name {_main_input(model)!r}, no nn.Embedding, and its first module with parameters is "
            f"a {type(first).__name__} (not a Linear or convolution to size an input for)")

