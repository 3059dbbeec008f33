"""The schedule picture: each PP rank's F / B / I / W actions with measured times, and the bubble.

``engine.recorder.enabled = True`` makes the engine time every action of the next steps (a clock
read around each: negligible next to a layer); ``engine.timeline()`` gathers the last step's record
from every PP rank::

    engine.recorder.enabled = True
    engine(x, y)
    tl = engine.timeline()             # on every PP rank (a collective)
    print(tl.text())                   # one row per rank, time left to right, '.' where it waits
    tl.bubble_fraction, tl.theory      # measured idle share vs (p - 1) / (v * m + p - 1)
    tl.save_png("schedule.png")        # needs matplotlib

Actions: ``F`` forward (on the last stage with its ``loss_fn``), ``B`` full backward, ``I`` / ``W``
zero-bubble's input / weight backward.

The bubble is each rank's time outside its actions over the *step*: the slowest rank's schedule,
which every rank's step lasts (the grad sync and the loss broadcast after the schedule wait for it),
averaged over ranks. That is Megatron's bubble (``t_pb`` idle per device over the iteration: each
device's share of the flush-to-flush time, ``(p - 1) / (v m + p - 1)`` when the stages are equal,
whatever the backward / forward ratio) and the one ``step_time.simulate_schedule`` predicts. A rank's
own schedule would leave out its wait for the slowest one (the last stages finish first under 1F1B):
with ideal actions that reads about 0.7x the theory. What runs between two actions (posting sends
and receives, torch's loop) counts as waiting: a device idles then unless its host queued the next
kernel ahead, which the simulated kernels of ``testing.py`` cannot.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch.distributed as dist

__all__ = ["TimelineRecorder", "ScheduleTimeline", "Action"]


@dataclass(frozen=True)
class Action:
    kind: str
    """``"F"``, ``"B"``, ``"I"`` or ``"W"``."""
    stage: int
    """The stage index (of the whole pipeline) the action ran."""
    micro_batch: int
    """The micro-batch it ran on."""
    start: float
    """Seconds since the step began on this rank."""
    end: float
    """Seconds since the step began when it ended."""


class TimelineRecorder:
    """Times the actions of a step while ``enabled``; keeps the last step's record."""

    def __init__(self) -> None:
        self.enabled = False
        self.actions: list[Action] = []
        self.duration = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        if self.enabled:
            self.actions, self._t0 = [], time.perf_counter()

    def stop(self) -> None:
        if self.enabled:
            self.duration = time.perf_counter() - self._t0

    @contextlib.contextmanager
    def action(self, stage: int, kind: str, micro_batch: int) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter() - self._t0
        try:
            yield
        finally:
            self.actions.append(Action(kind, stage, micro_batch, start, time.perf_counter() - self._t0))

    def extend(self, stage: int, kind: str, micro_batch: int) -> None:
        """Stretch the last action to now if it is ``kind`` of ``micro_batch`` on ``stage`` (the loss
        torch computes right after the last stage's forward is that forward's work, as in Megatron's
        ``forward_step``, not a wait)."""
        if self.enabled and self.actions:
            last = self.actions[-1]
            if (last.kind, last.stage, last.micro_batch) == (kind, stage, micro_batch):
                self.actions[-1] = replace(last, end=time.perf_counter() - self._t0)

    def gather(self, group: dist.ProcessGroup, resolved) -> ScheduleTimeline:
        if not self.actions:
            raise RuntimeError("no timeline recorded: set engine.recorder.enabled = True, then run a step")
        records: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(records, (self.actions, self.duration), group=group)
        return ScheduleTimeline([r[0] for r in records], [r[1] for r in records], resolved.pp_size,
                                resolved.num_microbatches, resolved.plan.virtual_chunks, resolved.schedule.__name__)


@dataclass
class ScheduleTimeline:
    """One step's actions on every PP rank (``ranks[r]``), with each rank's step duration."""

    ranks: list[list[Action]]
    durations: list[float]
    pp_size: int
    num_microbatches: int
    virtual_chunks: int
    schedule: str

    @property
    def bubble_fraction(self) -> float:
        """The share of the step (the slowest rank's duration) the ranks spent waiting, averaged over
        ranks (see the module's docstring)."""
        step = max(self.durations)
        if step <= 0:
            return 0.0
        return sum(1 - sum(a.end - a.start for a in acts) / step for acts in self.ranks) / len(self.ranks)

    @property
    def theory(self) -> float:
        """The bubble of a fill-drain schedule with equal action times: (p - 1) / (v * m + p - 1)."""
        p, m, v = self.pp_size, self.num_microbatches, self.virtual_chunks
        return (p - 1) / (v * m + p - 1)

    def text(self, width: int = 72) -> str:
        """Rows of actions in order, then time-proportional rows (``.`` = waiting), then the bubble."""
        lines = [f"{self.schedule}: PP={self.pp_size}, micro-batches={self.num_microbatches}, "
                 f"virtual chunks={self.virtual_chunks}"]
        for r, acts in enumerate(self.ranks):
            lines.append(f"rank {r} | " + " ".join(f"{a.stage}{a.kind}{a.micro_batch}" for a in acts))
        span = max(self.durations) or 1.0
        for r, acts in enumerate(self.ranks):
            row = ["."] * width
            for a in acts:
                lo, hi = int(a.start / span * width), max(int(a.start / span * width) + 1, int(a.end / span * width))
                for i in range(lo, min(hi, width)):
                    row[i] = a.kind
            lines.append(f"rank {r} |" + "".join(row) + "|")
        lines.append(f"bubble: measured {self.bubble_fraction:.3f}, theory (p-1)/(v*m+p-1) = {self.theory:.3f}")
        return "\n".join(lines)

    def save_png(self, path: str) -> None:
        """Draw the timeline (one bar row per rank) into ``path``; needs matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise RuntimeError("save_png needs matplotlib (pip install matplotlib); text() needs nothing") from err
        colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:green", "W": "tab:red"}
        fig, ax = plt.subplots(figsize=(10, 0.6 * self.pp_size + 1))
        for r, acts in enumerate(self.ranks):
            for a in acts:
                ax.broken_barh([(a.start, a.end - a.start)], (r - 0.4, 0.8), color=colors[a.kind])
                ax.text((a.start + a.end) / 2, r, f"{a.kind}{a.micro_batch}", ha="center", va="center", fontsize=6)
        ax.set_yticks(range(self.pp_size), [f"rank {r}" for r in range(self.pp_size)])
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(f"{self.schedule}: bubble {self.bubble_fraction:.3f} (theory {self.theory:.3f})")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
