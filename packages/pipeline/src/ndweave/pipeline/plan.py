"""``PipelineParallelPlan``: how a model is cut into stages and which torch schedule runs them.

The plan is plain data. What depends on the mesh (how many stages, which of them this rank holds,
whether the number of micro-batches suits the schedule) is answered by :func:`resolve_plan` once the
pipeline-parallel size is known, so one plan serves every mesh shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)

__all__ = ["PipelineParallelPlan", "ResolvedPlan", "resolve_plan", "SCHEDULE_NAMES"]

#: Our names for torch's schedules (torch's own names, e.g. ``"Interleaved1F1B"``, are accepted too).
SCHEDULE_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "zero_bubble": "InterleavedZeroBubble",
    "looped_bfs": "LoopedBFS",
    "zbv_zero_bubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}

# V-shaped schedules place stage s and stage 2p-1-s on PP rank s (torch's "v" stage mapping).
_V_SHAPED = (ScheduleZBVZeroBubble, ScheduleDualPipeV)


@dataclass
class PipelineParallelPlan:
    """How to cut a model into pipeline stages and run them (veScale's ``PipelineParallelPlan``)::

        plan = PipelineParallelPlan(num_microbatches=8, schedule_type="1f1b",
                                    split_points=["transformer.h.2", "transformer.h.4", "transformer.h.6"])
    """

    num_stages: int | None = None
    """Stages in the whole pipeline. Default: the PP size times ``virtual_chunks``; otherwise it must
    equal that product (every PP rank holds ``virtual_chunks`` stages)."""

    virtual_chunks: int = 1
    """Stages per PP rank. ``1`` for ``"gpipe"`` / ``"1f1b"``; 2 or more interleaves them
    (``"interleaved_1f1b"``, ``"zero_bubble"``, ``"looped_bfs"``; V-shaped schedules need 2)."""

    split_points: Sequence[str] | None = None
    """FQNs of the modules where stages 1, 2, ... begin (``num_stages - 1`` of them, in model order),
    e.g. ``["transformer.h.2"]``. A container's FQN means its first entry. ``None``: ``split_method``."""

    split_method: str = "uniform"
    """Used when ``split_points`` is ``None``. ``"uniform"``: contiguous stages balanced by parameter
    count (the largest stage is as small as it can be). ``"time"`` (a traced model on a device): by
    each layer's forward + backward time, measured once on the example inputs."""

    schedule_type: str = "1f1b"
    """``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"`` (torch's
    ``ScheduleInterleavedZeroBubble``: split input/weight backward), ``"looped_bfs"``,
    ``"zbv_zero_bubble"``, ``"dualpipev"``, or a name torch's ``get_schedule_class`` knows."""

    num_microbatches: int | None = None
    """Micro-batches each mini-batch is split into along tensor dim 0 (it must divide the batch).
    Default: ``num_stages``, the fewest that keep every stage busy in 1F1B's steady state."""

    shared_modules: Sequence[Sequence[str]] = ()
    """Groups of module or parameter FQNs whose parameters are one weight living on several stages,
    e.g. ``[["transformer.wte", "lm_head"]]``. Parameters that already are one tensor in the model
    (a tied embedding and LM head) are found without this; list groups the model does not tie."""

    activation_recompute: bool | Sequence[int] = False
    """Recompute activations in backward instead of keeping them (``torch.utils.checkpoint``,
    non-reentrant): ``True`` for every stage, or the stage indices that should."""

    p2p_dtype: torch.dtype | None = None
    """dtype of the activations and their gradients sent between stages (e.g. ``torch.bfloat16``);
    ``None`` sends them as computed. Each stage computes in its parameters' dtype."""

    def __post_init__(self) -> None:
        if self.virtual_chunks < 1:
            raise ValueError(f"virtual_chunks must be >= 1, got {self.virtual_chunks}")
        if self.num_microbatches is not None and self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.split_points is None and self.split_method not in ("uniform", "time"):
            raise ValueError(f"split_method must be 'uniform' or 'time' (or give split_points); got {self.split_method!r}")
        if isinstance(self.split_points, str):
            raise TypeError(f"split_points is a list of FQNs; got the string {self.split_points!r}")
        for group in self.shared_modules:
            if isinstance(group, str) or len(group) < 2:
                raise ValueError(f"each shared_modules group lists two or more FQNs; got {group!r}")
        schedule_class(self.schedule_type)  # unknown names fail here, not on the first step


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan with the mesh-dependent answers filled in (see :func:`resolve_plan`)."""

    plan: PipelineParallelPlan
    pp_size: int
    num_stages: int
    num_microbatches: int
    schedule: type
    v_shaped: bool = field(default=False)

    def stage_rank(self, stage: int) -> int:
        """The PP rank holding ``stage``."""
        if self.v_shaped:
            return stage if stage < self.pp_size else 2 * self.pp_size - 1 - stage
        return stage % self.pp_size

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages ``pp_rank`` holds, in increasing order."""
        return [s for s in range(self.num_stages) if self.stage_rank(s) == pp_rank]

    @property
    def single_stage(self) -> bool:
        """Whether the schedule drives one stage per rank (GPipe, 1F1B)."""
        return issubclass(self.schedule, PipelineScheduleSingle)

    def recomputes(self, stage: int) -> bool:
        flag = self.plan.activation_recompute
        return bool(flag) if isinstance(flag, bool) else stage in set(flag)


def schedule_class(name: str) -> type:
    """torch's schedule class for one of our names or one of torch's (case and ``_`` ignored)."""
    key = SCHEDULE_NAMES.get(name.lower(), name)
    key = key.replace("_", "")
    if key.lower().startswith("schedule"):
        key = key[len("schedule"):]
    try:
        cls = get_schedule_class(key)
    except ValueError:
        raise ValueError(
            f"unknown schedule_type {name!r}; use one of {sorted(SCHEDULE_NAMES)} or a torch schedule name"
        ) from None
    if cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        raise ValueError(f"schedule_type {name!r} names torch's base class, not a schedule")
    return cls


def resolve_plan(plan: PipelineParallelPlan, pp_size: int) -> ResolvedPlan:
    """Fill in the plan's defaults for a PP dim of ``pp_size`` ranks and check that they fit together:
    stage count, stages per rank for the schedule, and the micro-batch count the schedule needs."""
    cls = schedule_class(plan.schedule_type)
    expected = pp_size * plan.virtual_chunks
    num_stages = expected if plan.num_stages is None else plan.num_stages
    if num_stages != expected:
        raise ValueError(
            f"num_stages={num_stages} but PP size {pp_size} x virtual_chunks {plan.virtual_chunks} = {expected}; "
            f"set virtual_chunks={num_stages // pp_size if num_stages % pp_size == 0 else '?'} or leave num_stages unset"
        )
    resolved = ResolvedPlan(plan, pp_size, num_stages, plan.num_microbatches or num_stages, cls,
                            v_shaped=issubclass(cls, _V_SHAPED))
    if resolved.single_stage and plan.virtual_chunks != 1:
        raise ValueError(
            f"schedule_type {plan.schedule_type!r} runs one stage per rank, but virtual_chunks={plan.virtual_chunks}; "
            "use 'interleaved_1f1b', 'zero_bubble' or 'looped_bfs' for several stages per rank"
        )
    if resolved.v_shaped and plan.virtual_chunks != 2:
        raise ValueError(f"schedule_type {plan.schedule_type!r} is V-shaped and needs virtual_chunks=2")
    _check_microbatches(resolved)
    return resolved


def _check_microbatches(r: ResolvedPlan) -> None:
    m, name = r.num_microbatches, r.plan.schedule_type
    minimum = {"Schedule1F1B": r.pp_size, "ScheduleDualPipeV": r.num_stages}.get(r.schedule.__name__, 1)
    if m < minimum:
        raise ValueError(
            f"schedule_type {name!r} needs num_microbatches >= {minimum} on this mesh "
            f"({r.num_stages} stages over PP size {r.pp_size}), got {m}; raise num_microbatches to {minimum} "
            "or use 'gpipe', which runs any number"
        )
    if r.schedule.__name__ in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        # torch runs these in rounds of m // PP micro-batches, which must divide m
        rounds = max(1, m // r.pp_size)
        if m % rounds:
            near = [k for k in range(max(1, m - r.pp_size), m + 2 * r.pp_size) if k % max(1, k // r.pp_size) == 0]
            raise ValueError(
                f"schedule_type {name!r} runs micro-batches in rounds of num_microbatches // PP size, which must "
                f"divide num_microbatches: {m} does not work with PP size {r.pp_size}; nearby values that do: {near[:4]}"
            )
