"""Deprecated: moved to :mod:`ndweave.plan.layouts` (``ndweave-plan``)."""

from ndweave.mesh._moved import moved

_layouts = moved("ndweave.mesh.planner", "ndweave.plan.layouts", distribution="ndweave-plan", stacklevel=4)
__all__ = list(_layouts.__all__)
globals().update({name: getattr(_layouts, name) for name in __all__})
