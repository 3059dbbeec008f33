"""Deprecated: moved to :mod:`ndweave.dmodule.infer.trace` (``ndweave-dmodule``), its one user."""

from ndweave.mesh._moved import moved

_trace = moved("ndweave.mesh.trace", "ndweave.dmodule.infer.trace", distribution="ndweave-dmodule", stacklevel=4)
__all__ = list(_trace.__all__)
globals().update({name: getattr(_trace, name) for name in __all__})
