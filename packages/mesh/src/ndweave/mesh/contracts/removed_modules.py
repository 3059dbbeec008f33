"""Marking the modules a pipeline stage removed from a model, so plans written for the whole model
apply to the stage unchanged.

A pipeline stage is the original model with other stages' layers replaced by parameter-free
placeholders, so every FQN it keeps is the original one. A sharding plan written for the whole model
(``ndweave.dmodule``'s zoo plans) then names modules a stage does not hold. The stage's root carries
the FQNs (and class names) of every module it removed, so the plan's consumer can tell a key that
names a removed module (skipped) from a typo (an error)::

    from ndweave.mesh.contracts import mark_removed_modules, removed_modules

    mark_removed_modules(stage, {"transformer.h.0": "Block", "transformer.h.0.attn": "CausalSelfAttention"})
    removed_modules(stage)          # {"transformer.h.0": "Block", ...}; {} for an unmarked module
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["mark_removed_modules", "removed_modules"]

# Kept on the module object itself (no registry here): it lives and dies with the stage.
_MARK = "_ndweave_removed_modules"


def mark_removed_modules(root: nn.Module, removed: Mapping[str, str]) -> nn.Module:
    """Record on ``root`` that the modules at these FQNs (FQN -> class name) were removed; returns it."""
    if not isinstance(root, nn.Module):
        raise TypeError(f"mark_removed_modules takes the stage's root module; got {type(root).__name__}")
    root.__dict__[_MARK] = dict(removed)
    return root


def removed_modules(root: nn.Module) -> Mapping[str, str]:
    """FQN -> class name of every module removed from ``root`` (empty if none were)."""
    return dict(root.__dict__.get(_MARK, {}))
