"""The model's inputs as the pipeline takes them: a tensor, a tuple of tensors (positional
arguments of the model's ``forward``) or a dict name -> tensor (keyword arguments)::

    engine(ids, targets)                                                   # one tensor
    engine((ids, mask), targets)                                           # positional
    engine({"input_ids": ids, "attention_mask": mask}, targets)            # keyword
    construct_pipeline_stage(model, plan, mesh, example_inputs={"input_ids": ids[:2], "pixel_values": px[:2]})

torch's schedules split every tensor of ``schedule.step(*args, **kwargs)`` into micro-batches along
dim 0, but hand keyword arguments to *every* stage of a rank (an interleaved schedule's later stages
too). So the engine sends all the tensors positionally, in one flat tuple, and the first stage
rebuilds the positional and keyword arguments from it (:class:`InputLayout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["InputLayout", "ModelInputs", "check_inputs", "check_same_inputs", "check_targets", "flatten_inputs",
           "input_shapes", "split_inputs"]

ModelInputs = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
"""A tensor, a tuple of tensors (positional), or a dict name -> tensor (keyword arguments)."""


@dataclass(frozen=True)
class InputLayout:
    """Which of a batch's flat tensors are positional and which keyword arguments, by name."""

    names: tuple[str, ...]
    """Each tensor's name in messages: ``inputs`` (one tensor), ``inputs[i]`` (positional), the key."""
    keywords: tuple[str, ...] = ()
    """The names passed by keyword (the dict's keys), after the positional ones."""

    def rebuild(self, tensors: Sequence[Any]) -> tuple[tuple, dict[str, Any]]:
        """The ``(args, kwargs)`` of the model's forward from the flat ``tensors``."""
        num_positional = len(self.names) - len(self.keywords)
        return tuple(tensors[:num_positional]), dict(zip(self.keywords, tensors[num_positional:]))


def split_inputs(inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of a tensor, a tuple / list or a dict of inputs (values of any kind)."""
    if isinstance(inputs, Mapping):
        bad = [key for key in inputs if not isinstance(key, str)]
        if bad:
            raise TypeError(f"the inputs' dict maps the forward's parameter names to tensors; got the keys {bad}")
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def flatten_inputs(inputs: ModelInputs) -> tuple[InputLayout, tuple]:
    """The :class:`InputLayout` of ``inputs`` and its values in the layout's order."""
    args, kwargs = split_inputs(inputs)
    if isinstance(inputs, torch.Tensor):
        names: tuple[str, ...] = ("inputs",)
    else:
        names = tuple(f"inputs[{i}]" for i in range(len(args))) + tuple(kwargs)
    return InputLayout(names, tuple(kwargs)), (*args, *kwargs.values())


def check_inputs(inputs: Any, num_microbatches: int, stage: str = "first") -> InputLayout:
    """Refuse (``ValueError``, one line naming the input and the fix) inputs the schedule cannot split
    into ``num_microbatches`` equal micro-batches: not tensors, no samples dim, dim 0 differing
    between inputs or not divisible. Returns their layout."""
    if inputs is None or isinstance(inputs, (Mapping, tuple, list)) and not len(inputs):
        raise ValueError(f"it holds the {stage} stage and needs inputs: a tensor, a tuple of tensors or a dict "
                         f"name -> tensor, with the samples along dim 0; got {inputs!r}")
    layout, values = flatten_inputs(inputs)
    for name, value in zip(layout.names, values):
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            raise ValueError(f"input {name!r} must be a tensor with the samples along dim 0 (every input is "
                             f"split into micro-batches); got {_short(value)}")
    sizes = {name: value.shape[0] for name, value in zip(layout.names, values)}
    first_name, samples = next(iter(sizes.items()))
    for name, size in sizes.items():
        if size != samples:
            raise ValueError(f"input {name!r} has {size} samples along dim 0, but {first_name!r} has {samples}; "
                             "every input is split into micro-batches along dim 0: give each the same samples")
    if samples % num_microbatches:
        raise ValueError(f"inputs have {samples} samples along dim 0, which does not split into "
                         f"num_microbatches={num_microbatches} equal micro-batches; use a batch size divisible by it")
    return layout


def check_targets(targets: Any, num_microbatches: int) -> None:
    """Refuse targets the schedule cannot split into ``num_microbatches`` equal micro-batches."""
    if not isinstance(targets, torch.Tensor) or targets.ndim == 0:
        raise ValueError(f"it holds the last stage and needs targets, a tensor with the samples along dim 0; "
                         f"got {_short(targets)}")
    if targets.shape[0] % num_microbatches:
        raise ValueError(f"targets has {targets.shape[0]} samples along dim 0, which does not split into "
                         f"num_microbatches={num_microbatches} equal micro-batches; use a batch size divisible by it")


def check_same_inputs(now: Mapping[str, tuple[int, ...]], first: Mapping[str, tuple[int, ...]] | None,
                      what: str = "the first step's") -> None:
    """Refuse a batch whose input names or shapes differ from ``first`` (the stages' buffers were
    sized for it); ``first=None``: this is the first batch."""
    if first is None:
        return
    if list(now) != list(first):
        raise ValueError(f"this batch's inputs are {list(now)}, {what} were {list(first)}; torch's stages were "
                         "built for those: pass the same inputs (names and order) every step")
    for name, shape in now.items():
        if shape != first[name]:
            raise ValueError(
                f"input {name!r} has shape {shape}, {what} had {first[name]}; the stages' activation shapes are "
                "fixed at the first batch: keep one batch shape (a DataLoader with drop_last=True, padding to "
                "one length) or build a new PipeEngine for another shape"
            )


def input_shapes(inputs: ModelInputs) -> dict[str, tuple[int, ...]]:
    """Each input's shape by name (inputs already checked by :func:`check_inputs`)."""
    layout, values = flatten_inputs(inputs)
    return {name: tuple(value.shape) for name, value in zip(layout.names, values)}


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
