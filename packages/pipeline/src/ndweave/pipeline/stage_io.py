"""``StageIO``: what crosses the cut between two stages, and how it travels as torch's stages need it.

torch's ``PipelineStage`` hands a stage's output to the next stage as a flat tuple of tensors. The
values crossing a cut are whatever the root ``forward`` left live there: the hidden states, often a
mask or position ids beside them, a tuple a layer returned (rotary ``(cos, sin)``), a sequence
length. Each is flattened into leaves (torch's pytree, through ``torch_compat``) and each leaf travels by kind:

* a tensor as itself (a DTensor with its placements: a sequence-parallel shard stays a shard);
* an int or bool in the *shape* of an empty tensor (``(|v|, v < 0, 0)``, no bytes): exact even in
  torch's shape inference, which runs the next stage on uninitialized buffers;
* a ``torch.device`` as the receiving stage's own device;
* a constant (``None``, a dtype, a string) not at all: the receiver knows it from the trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ndweave.mesh.torch_compat import tree_flatten, tree_unflatten
from ndweave.pipeline.order import ExecutionOrder, describe_node, leaf_kind

__all__ = ["CrossingValue", "StageIO", "build_stage_io", "first_tensor"]


@dataclass(frozen=True)
class CrossingValue:
    """One value of the root ``forward`` live across a cut."""

    name: str
    """The traced node's name (``transformer_h_1``, ``unsqueeze``, ``model_rotary_emb``)."""
    origin: str
    """What computed it, with the forward's source line where known."""
    spec: Any
    """Its pytree structure (a tensor, a tuple of two tensors, a dict, ...)."""
    kinds: tuple[str, ...]
    """How each leaf travels: ``"tensor"``, ``"int"``, ``"bool"``, ``"device"``, ``"constant"``."""
    constants: tuple[Any, ...]
    """Each leaf's traced value where its kind is ``"constant"`` (else ``None``)."""


@dataclass(frozen=True)
class StageIO:
    """What crosses the cut before ``stage``: the values the earlier stages computed that it or a later
    stage uses, flattened into the tensors torch's stages send (``module.stage_io[s]``, s >= 1)::

        print(module.stage_io[1])
        # before stage 1 ('transformer.h.1'): 1 value, 1 tensor
        #   transformer_h_0 (the output of 'transformer.h.0'): tensor
    """

    stage: int
    """The stage receiving these values."""
    before: str
    """The layer the stage begins with (where the cut is)."""
    values: tuple[CrossingValue, ...]

    @property
    def num_tensors(self) -> int:
        """Tensors sent per micro-batch (sequence lengths included, as empty tensors)."""
        return sum(kind in ("tensor", "int", "bool") for value in self.values for kind in value.kinds)

    def flatten(self, values: Sequence[Any], device: torch.device) -> tuple[torch.Tensor, ...]:
        """The tensors to send for ``values`` (one per crossing value, in order)."""
        if len(values) != len(self.values):
            raise ValueError(f"{self}: expected {len(self.values)} values, got {len(values)}")
        sent: list[torch.Tensor] = []
        for value, spec in zip(values, self.values):
            for leaf, kind in zip(tree_flatten(value)[0], spec.kinds, strict=True):
                if kind == "tensor":
                    sent.append(leaf)
                elif kind in ("int", "bool"):
                    sent.append(torch.empty((abs(int(leaf)), int(leaf < 0), 0), dtype=torch.int8, device=device))
        return tuple(sent)

    def unflatten(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[Any]:
        """The values ``tensors`` carry (inverse of :meth:`flatten` on the receiving stage)."""
        received = iter(tensors)
        values = []
        for spec in self.values:
            leaves = []
            for kind, constant in zip(spec.kinds, spec.constants):
                if kind == "tensor":
                    leaves.append(next(received))
                elif kind in ("int", "bool"):
                    shape = next(received).shape
                    number = -shape[0] if shape[1] else shape[0]
                    leaves.append(bool(number) if kind == "bool" else number)
                elif kind == "device":
                    leaves.append(device)
                else:
                    leaves.append(constant)
            values.append(tree_unflatten(leaves, spec.spec))
        return values

    def __str__(self) -> str:
        lines = [f"before stage {self.stage} ({self.before!r}): {len(self.values)} value(s), {self.num_tensors} tensor(s)"]
        lines += [f"  {value.origin}: {', '.join(value.kinds)}" for value in self.values]
        return "\n".join(lines)


def build_stage_io(order: ExecutionOrder, cut: int, stage: int, before: str) -> StageIO:
    """The :class:`StageIO` of the cut at node position ``cut`` (checked sendable by the split)."""
    values = []
    for node in order.crossing(cut):
        leaves, spec = tree_flatten(order.forward.values[node])
        kinds = tuple(leaf_kind(leaf) for leaf in leaves)
        constants = tuple(leaf if kind == "constant" else None for leaf, kind in zip(leaves, kinds))
        values.append(CrossingValue(node.name, describe_node(node), spec, kinds, constants))
    return StageIO(stage, before, tuple(values))


def first_tensor(output: Any) -> torch.Tensor:
    """The tensor a stage hands on: the output itself, or the first tensor in a tuple / list / dict /
    HF ``ModelOutput`` (``(logits, loss)`` -> logits)."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"a pipeline stage must output a tensor (or a tuple/list/dict holding one); got {type(output).__name__}")
