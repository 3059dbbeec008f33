"""What a memory estimate is made of, shared by the packages that each model their own layout and by
whoever adds them up (a job, the layout planner).

Each package answers for what it allocates (ddp: parameter and grad buffers, optim: master weights and
state, pipeline: the activations its schedule keeps in flight, dmodule: the local shapes tensor
parallelism gives); a :class:`MemoryTerm` carries one answer with the package that gave it, and a
:class:`RankMemory` is one rank's sum, so a table can say where every byte comes from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["MemoryTerm", "RankMemory", "StepTime", "TimeTerm"]


@dataclass(frozen=True)
class MemoryTerm:
    """One kind of memory on one rank."""

    name: str
    """What it is: ``"parameters"``, ``"gradients"``, ``"optimizer state"``, ``"activations"``, ..."""
    bytes: int
    owner: str
    """The package (or job) whose layout function computed it, e.g. ``"ddp"``."""
    persistent: bool = True
    """Held for the whole run (model state, data); ``False``: it peaks during a step (activations,
    temporaries)."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimated memory: its terms and their sum, the peak."""

    coordinate: Mapping[str, int]
    """The rank's index on each mesh dim, e.g. ``{"PP": 1, "DP": 0, "TP": 1}``."""
    terms: tuple[MemoryTerm, ...] = field(default_factory=tuple)

    @property
    def peak(self) -> int:
        """Bytes held at the step's peak: every term at its most at once."""
        return sum(t.bytes for t in self.terms)

    def by_name(self) -> dict[str, int]:
        """``{term name: bytes}`` (terms of one name added)."""
        out: dict[str, int] = {}
        for t in self.terms:
            out[t.name] = out.get(t.name, 0) + t.bytes
        return out


@dataclass(frozen=True)
class TimeTerm:
    """One part of a training step's time (a step-time estimate's :class:`MemoryTerm`)."""

    name: str
    """What it is: ``"pipeline schedule"``, ``"grad sync"``, ``"optimizer step"``, ..."""
    seconds: float
    owner: str
    """The package (or job) whose model computed it, e.g. ``"pipeline"``."""
    in_total: bool = True
    """Part of the step's sum; ``False``: a breakdown of another term (the compute inside the
    schedule, its bubble), shown, not added again."""


@dataclass(frozen=True)
class StepTime:
    """One training step's estimated time: its terms, and their sum, the step."""

    terms: tuple[TimeTerm, ...] = field(default_factory=tuple)

    @property
    def seconds(self) -> float:
        """The step: the terms that follow one another (``in_total``) added up."""
        return sum(t.seconds for t in self.terms if t.in_total)

    def by_name(self) -> dict[str, float]:
        """``{term name: seconds}`` (terms of one name added)."""
        out: dict[str, float] = {}
        for t in self.terms:
            out[t.name] = out.get(t.name, 0.0) + t.seconds
        return out
