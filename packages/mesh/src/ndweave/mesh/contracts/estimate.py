"""Deprecated: moved to :mod:`ndweave.plan.estimate` (``ndweave-plan``)."""

from ndweave.mesh._moved import moved

_estimate = moved("ndweave.mesh.contracts.estimate", "ndweave.plan.estimate", distribution="ndweave-plan",
                  stacklevel=4)
__all__ = list(_estimate.__all__)
globals().update({name: getattr(_estimate, name) for name in __all__})
