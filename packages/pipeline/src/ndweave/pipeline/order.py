"""Execution order from a traced forward: where each layer first runs, and what a cut there would carry.

A *cut* is a position in the traced graph, just before a layer's first call: everything before it
runs on earlier stages, everything after on later ones. The values *crossing* it are the nodes
defined before it that something after it uses (the hidden states, and any mask, position ids or
sequence length the root computed once and later layers read). Parameters read directly by the
root forward are not values that cross: each stage fetches its own.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ndweave.mesh.torch_compat import tree_flatten
from ndweave.pipeline.trace import ForwardGraph

__all__ = ["ExecutionOrder", "leaf_kind", "describe_node"]

# what a leaf of a value crossing a cut may be: sent, or known on the other side
_CONSTANTS = (str, torch.dtype, torch.layout, torch.memory_format, type(None), type(Ellipsis))


def leaf_kind(leaf: Any) -> str | None:
    """How one leaf of a crossing value travels: ``"tensor"``, ``"int"`` / ``"bool"`` (a sequence
    length, in the shape of an empty tensor), ``"device"`` (the receiving stage's own),
    ``"constant"`` (``None``, a dtype: the traced value); ``None`` when it cannot."""
    if isinstance(leaf, torch.Tensor):
        return "tensor"
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        return "int"
    if isinstance(leaf, torch.device):
        return "device"
    if isinstance(leaf, _CONSTANTS):
        return "constant"
    return None


def describe_node(node: fx.Node) -> str:
    """What computed a node, in the user's words: ``output of 'transformer.h.1'``, ``torch.arange``
    (with the forward's source line when fx recorded it)."""
    if node.op == "call_module":
        what = f"the output of {node.target!r}"
    elif node.op == "placeholder":
        what = f"the input {node.target!r}"
    elif node.op == "call_method":
        what = f"Tensor.{node.target}"
    else:
        module = (getattr(node.target, "__module__", None) or "").replace("_operator", "operator")
        module = "torch" if module.split(".")[:2] == ["torch", "_C"] else module  # builtins: torch.xxx
        what = getattr(node.target, "__qualname__", str(node.target))
        what = f"{module}.{what}" if module and module != "builtins" else what
    return f"{node.name} ({what}{_source_line(node)})"


def _source_line(node: fx.Node) -> str:
    """``; model.py:130 `T = idx.shape[1]``` from the first (the user's) frame fx recorded."""
    lines = (node.stack_trace or "").strip().splitlines()
    match = re.match(r'File "(.+)", line (\d+)', lines[0]) if len(lines) > 1 else None
    return f"; {os.path.basename(match[1])}:{match[2]} `{lines[1].strip()}`" if match else ""


@dataclass
class ExecutionOrder:
    """The layers in the order the forward first calls them, and the cuts between them."""

    forward: ForwardGraph
    nodes: list[fx.Node] = field(init=False)
    index: dict[fx.Node, int] = field(init=False)
    calls: dict[str, list[int]] = field(init=False)
    """Node indices of every call of each layer, by FQN, in execution order of first calls."""

    def __post_init__(self) -> None:
        self.nodes = self.forward.nodes
        self.index = {node: i for i, node in enumerate(self.nodes)}
        self.calls = {}
        for i, node in enumerate(self.nodes):
            if node.op == "call_module":
                self.calls.setdefault(node.target, []).append(i)

    @property
    def layers(self) -> list[str]:
        """Layer FQNs in execution order (of first call)."""
        return list(self.calls)

    def cut_before(self, fqn: str) -> int | None:
        """The cut just before ``fqn`` first runs (a layer, or a module holding layers: its first one
        to run); ``None`` if it never runs."""
        hits = [calls[0] for layer, calls in self.calls.items() if layer == fqn or layer.startswith(fqn + ".")]
        return min(hits) if hits else None

    def crossing(self, cut: int) -> list[fx.Node]:
        """Values defined before ``cut`` and used at or after it, in definition order."""
        return [node for node in self.nodes[:cut] if node.op != "get_attr"
                and any(self.index[user] >= cut for user in node.users)]

    def blocker(self, cut: int) -> str | None:
        """Why the forward cannot be cut at ``cut`` (a value that cannot cross), or ``None``."""
        for node in self.crossing(cut):
            leaves, _ = tree_flatten(self.forward.values[node])
            bad = next((leaf for leaf in leaves if leaf_kind(leaf) is None), _NOTHING)
            if bad is not _NOTHING:
                return (f"{describe_node(node)} is needed after the cut and holds a {type(bad).__name__}, "
                        "which cannot cross a stage boundary (tensors, ints, devices and constants can)")
        return None

    def stage_of(self, cuts: list[int], position: int) -> int:
        """The stage running the node at ``position``, for stages starting at ``cuts``."""
        return bisect.bisect_right(cuts, position) - 1


_NOTHING = object()
