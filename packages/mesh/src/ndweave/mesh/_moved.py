"""Deprecated aliases for names that left ``ndweave.mesh`` in 0.10, kept for one release (removed in 0.11).

The planner, calibration, the work counter and the estimate vocabulary moved to ``ndweave-plan``, the
record-only tracer to its one user ``ndweave.dmodule.infer.trace``: the mesh package depends on no
sibling, so an old name is looked up in its new home only when asked for, and says where it went.
"""

from __future__ import annotations

import importlib
import warnings

__all__ = ["moved"]


def moved(old: str, new_module: str, name: str | None = None, *, distribution: str, stacklevel: int = 3):
    """The module ``new_module`` (or its attribute ``name``), with a ``DeprecationWarning`` that ``old``
    moved there; an ``ImportError`` naming the distribution to install when it is not installed."""
    new = f"{new_module}.{name}" if name else new_module
    warnings.warn(f"{old} moved to {new} ({distribution}); the old name is removed in ndweave-mesh 0.11",
                  DeprecationWarning, stacklevel=stacklevel)
    try:
        module = importlib.import_module(new_module)
    except ModuleNotFoundError as e:
        raise ImportError(f"{old} moved to {new}: pip install {distribution}") from e
    return getattr(module, name) if name else module
