"""Deprecated: moved to :mod:`ndweave.plan.calibrate` and :mod:`ndweave.plan.work` (``ndweave-plan``)."""

import importlib

from ndweave.mesh._moved import moved

_calibrate = moved("ndweave.mesh.calibrate", "ndweave.plan.calibrate", distribution="ndweave-plan", stacklevel=4)
_work = importlib.import_module("ndweave.plan.work")  # Work and WorkCounter: one warning above is enough
__all__ = [*_calibrate.__all__, *_work.__all__]
globals().update({name: getattr(_calibrate if name in _calibrate.__all__ else _work, name) for name in __all__})
