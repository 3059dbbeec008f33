"""Checking ``init_device_mesh``'s ``device_type``, ``mesh_shape`` and ``mesh_dim_names`` before
anything is built.

The shape and names are read by torch as plain sequences, so some mistakes used to pass as something
else: float sizes were truncated (``(2.0, 2.5)`` became ``(2, 2)``) and a string of names was split
into its letters (``"DT"`` became ``("D", "T")``). A device type this process has no device of
failed deep inside torch: ``"cuda"`` on a CPU-only machine with a process group already made ended
in an ``AttributeError`` about a missing CUDA binding of torch, raised from ``DeviceMesh``.
Each is refused here, naming the value and the fix.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_device_type", "check_mesh_shape", "check_mesh_dim_names"]


def check_device_type(device_type: Any) -> str:
    """``device_type`` (``"cpu"``, ``"cuda"``, ...) if this process has such a device; else a clear error."""
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"device_type must be a device type such as 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cpu":
        return device_type
    try:
        module = torch.get_device_module(device_type)
    except (AttributeError, RuntimeError, ValueError):
        raise ValueError(f"device_type {device_type!r} is not a device type torch knows: pass 'cpu' or 'cuda' "
                         "(a device index is not part of it: 'cuda', not 'cuda:0')") from None
    if not module.is_available() or module.device_count() == 0:
        raise ValueError(
            f"device_type {device_type!r}: this process sees no {device_type} device (torch.{device_type}."
            f"is_available() is False: a CPU-only torch build, no device on this machine, or one hidden by "
            f"{device_type.upper()}_VISIBLE_DEVICES). Pass 'cpu' to run on CPU (gloo), or run where the devices "
            "are visible")
    return device_type


def check_mesh_shape(mesh_shape: Any) -> tuple[int, ...]:
    """``mesh_shape`` as a tuple of positive ints; a clear error for anything else (no truncation)."""
    if isinstance(mesh_shape, (str, bytes)) or not hasattr(mesh_shape, "__iter__"):
        raise TypeError(f"mesh_shape must be a tuple of ints, e.g. (2, 4); got {mesh_shape!r}")
    shape = []
    for size in mesh_shape:
        try:  # operator.index takes ints (numpy's too) and refuses floats, which int() would truncate
            if isinstance(size, bool):
                raise TypeError
            shape.append(operator.index(size))
        except TypeError:
            raise TypeError(f"mesh_shape {tuple(mesh_shape)!r} holds {size!r}: each size must be an int "
                            "(a float is not rounded for you; pass e.g. (2, 4))") from None
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"mesh_shape {tuple(shape)} must be a non-empty tuple of positive sizes")
    return tuple(shape)


def check_mesh_dim_names(shape: tuple[int, ...], names: Sequence[str] | None,
                         defaults: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` as a tuple, one distinct string per dim of ``shape``; ``None``: the last
    ``len(shape)`` of ``defaults``."""
    if names is None:
        if len(shape) > len(defaults):
            raise ValueError(f"a {len(shape)}-D mesh needs mesh_dim_names; defaults exist only up to "
                             f"{len(defaults)} dims {defaults}")
        return defaults[-len(shape):]
    if isinstance(names, str):
        # the usual intents: one letter per dim, the whole string as a 1-D mesh's name, the default names
        options = [tuple(names)] if len(names) == len(shape) else []
        options += [(names,)] if len(shape) == 1 else []
        options += [defaults[-len(shape):]] if len(shape) <= len(defaults) else []
        raise TypeError(f"mesh_dim_names={names!r} is one string, not one name per dim: pass a tuple, e.g. "
                        + " or ".join(map(repr, dict.fromkeys(options) or [("DP", "TP")])))
    names = tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names but mesh_shape {shape} has {len(shape)} dims")
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"mesh_dim_names {names}: each name must be a non-empty string, got {bad}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"mesh_dim_names {names} repeat {dupes}; each dim needs its own name")
    return names
