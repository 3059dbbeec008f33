"""ndweave.plan: which layout to launch, decided before anything is allocated.

Layout search (:mod:`ndweave.plan.layouts`), this machine's measured rates
(:mod:`ndweave.plan.calibrate`), the work a program asks of it (:mod:`ndweave.plan.work`) and the
vocabulary estimates are written in (:mod:`ndweave.plan.estimate`). It depends on ``ndweave-mesh``
only: what a layout costs comes from the caller, who adds up the packages' own ``cost`` models.
"""

# ``calibrate`` (the function) stays in its module: re-exported here it would hide the module of that name
from ndweave.plan.calibrate import CACHE_PATH, Machine, collective_seconds
from ndweave.plan.estimate import MemoryTerm, RankMemory, StepTime, TimeTerm
from ndweave.plan.layouts import Candidate, Layout, ModelShape, Planned, enumerate_layouts, plan_layout
from ndweave.plan.work import PhasedWork, Work, WorkCounter

__version__ = "0.2.0"

__all__ = [
    "CACHE_PATH",
    "Candidate",
    "Layout",
    "Machine",
    "MemoryTerm",
    "ModelShape",
    "PhasedWork",
    "Planned",
    "RankMemory",
    "StepTime",
    "TimeTerm",
    "Work",
    "WorkCounter",
    "__version__",
    "collective_seconds",
    "enumerate_layouts",
    "plan_layout",
]
