"""How long one step of a pipeline schedule takes, from each stage's forward and backward time: an
event simulation of the actions in the order torch runs them, before anything runs.

Every PP rank runs its actions one after the other, in torch's order (GPipe: every forward, then
every backward; 1F1B: ``min(m, num_stages - stage)`` forwards, then a backward and a forward in
turn, then the remaining backwards, as ``Schedule1F1B`` loops; the multi-stage schedules: the action
list torch builds for each rank, :func:`ndweave.pipeline.cost.torch_action_order`). An action
starts when its rank is free and its input has arrived:

* ``F`` of stage ``s`` needs ``F`` of stage ``s - 1`` on the same micro-batch, plus ``p2p_s`` when the
  two stages are on different ranks;
* ``B`` (or ``I``) of stage ``s`` needs the input grad of stage ``s + 1`` (its ``B`` or ``I``), plus
  ``p2p_s``; the last stage's needs only its own ``F`` (the loss is computed there);
* ``W`` needs only its own ``I`` (it is local).

Split backward (zero bubble, ZBV, DualPipeV): ``I`` (input grads) and ``W`` (weight grads) each take
half of ``backward_s``, as a linear layer's two grads take one matmul each (torch splits a stage's
backward this way and does not time the halves). Sends do not block the sender (torch posts them
asynchronously). With ``concurrency`` (ranks sharing fewer cores than there are ranks, e.g. 8 CPU
ranks on 2 cores) the ranks computing at a moment share that many ranks' speed equally.

    resolved = resolve_plan(PipelineParallelPlan(schedule_type="1f1b", num_microbatches=8), 4)
    schedule_seconds(resolved, [1.0] * 4, [2.0] * 4)     # 33.0: (m + p - 1) * (F + B)
    simulate_schedule(resolved, [1.0] * 4, [2.0] * 4).bubble_fraction   # 3 / 11 = (p - 1) / (m + p - 1)

``tests/pipeline/test_pipeline_step_time.py`` checks it against the bubble theory and against the
engine's measured timeline.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

from ndweave.pipeline.cost import torch_action_order
from ndweave.pipeline.plan import ResolvedPlan
from ndweave.pipeline.timeline import Action, ScheduleTimeline

__all__ = ["SPLIT_BACKWARD_INPUT_SHARE", "rank_actions", "schedule_seconds", "simulate_schedule"]

#: The share of a stage's backward its input-grad half (``I``) takes under split backward; ``W`` the rest.
SPLIT_BACKWARD_INPUT_SHARE = 0.5

_EPS = 1e-12


def schedule_seconds(resolved: ResolvedPlan, forward_s: Sequence[float], backward_s: Sequence[float],
                     p2p_s: float | Sequence[float] = 0.0, *, concurrency: float | None = None) -> float:
    """Seconds from the step's first action to its last, on the slowest rank (see the module's
    docstring and :func:`simulate_schedule`)."""
    return max(simulate_schedule(resolved, forward_s, backward_s, p2p_s, concurrency=concurrency).durations)


def simulate_schedule(resolved: ResolvedPlan, forward_s: Sequence[float], backward_s: Sequence[float],
                      p2p_s: float | Sequence[float] = 0.0, *, concurrency: float | None = None) -> ScheduleTimeline:
    """One step's predicted timeline, the picture ``engine.timeline()`` measures (``.text()``,
    ``.bubble_fraction``): every rank's actions with their predicted start and end.

    ``forward_s[s]`` / ``backward_s[s]``: seconds of one micro-batch's forward / full backward on
    stage ``s`` (index: stage); ``p2p_s``: seconds to send an activation (or its grad) from a stage
    to the next on another rank, one number or one per boundary (``p2p_s[s]``: stage ``s`` to
    ``s + 1``). ``concurrency``: how many ranks compute at full speed at once (``None``: all);
    when more run, each goes at ``concurrency / running`` of its speed. Every rank's duration is
    the step's (the grad sync and the loss broadcast after the schedule wait for the last rank), so
    ``bubble_fraction`` is the share of the step the ranks wait."""
    num_stages, m = resolved.num_stages, resolved.num_microbatches
    forward_s = _per_stage(forward_s, num_stages, "forward_s")
    backward_s = _per_stage(backward_s, num_stages, "backward_s")
    links = [p2p_s] * (num_stages - 1) if isinstance(p2p_s, (int, float)) else list(p2p_s)
    if len(links) != num_stages - 1:
        raise ValueError(f"simulate_schedule: p2p_s has {len(links)} entries, the pipeline {num_stages - 1} boundaries")
    if concurrency is not None and concurrency <= 0:
        raise ValueError(f"simulate_schedule: concurrency must be positive, got {concurrency}")
    share = SPLIT_BACKWARD_INPUT_SHARE
    seconds = {"F": forward_s, "B": backward_s, "I": [b * share for b in backward_s],
               "W": [b * (1 - share) for b in backward_s]}
    orders = rank_actions(resolved)
    ranks = range(resolved.pp_size)
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end
    timeline: list[list[Action]] = [[] for _ in ranks]
    nxt = [0] * resolved.pp_size
    running: dict[int, list] = {}  # rank -> [action, start, seconds of work left]
    now = 0.0
    while True:
        arrivals = []
        for r in ranks:
            if r in running or nxt[r] == len(orders[r]):
                continue
            kind, stage, mb = orders[r][nxt[r]]
            ready = _ready(kind, stage, mb, done, resolved, links, m)
            if ready is None:
                continue
            if ready <= now + _EPS:
                running[r] = [(kind, stage, mb), now, seconds[kind][stage]]
            else:
                arrivals.append(ready)
        if not running:
            if all(nxt[r] == len(orders[r]) for r in ranks):
                break
            if not arrivals:
                raise RuntimeError(f"simulate_schedule: the actions of {resolved.schedule.__name__} wait on each other "
                                   f"(next: {[orders[r][nxt[r]] for r in ranks if nxt[r] < len(orders[r])]})")
            now = min(arrivals)
            continue
        rate = 1.0 if concurrency is None else min(1.0, concurrency / len(running))
        step = min(left for _, _, left in running.values()) / rate
        if arrivals:
            step = min(step, min(arrivals) - now)
        now += step
        for r in list(running):
            running[r][2] -= step * rate
            if running[r][2] <= _EPS:
                (kind, stage, mb), start, _ = running.pop(r)
                done[(kind, stage, mb)] = now
                timeline[r].append(Action(kind, stage, mb, start, now))
                nxt[r] += 1
    span = max((a.end for acts in timeline for a in acts), default=0.0)
    return ScheduleTimeline(timeline, [span] * resolved.pp_size, resolved.pp_size, m, resolved.plan.virtual_chunks,
                            resolved.schedule.__name__)


def rank_actions(resolved: ResolvedPlan) -> dict[int, list[tuple[str, int, int]]]:
    """Each PP rank's actions ``(kind, stage, micro_batch)`` in the order torch runs them: GPipe's and
    1F1B's loops (``ScheduleGPipe`` / ``Schedule1F1B._step_microbatches``), else torch's action list
    (:func:`ndweave.pipeline.cost.torch_action_order`)."""
    m, num_stages = resolved.num_microbatches, resolved.num_stages
    if resolved.schedule is ScheduleGPipe:
        return {s: [("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)] for s in range(num_stages)}
    if resolved.schedule is Schedule1F1B:
        out = {}
        for s in range(num_stages):
            warmup = min(m, num_stages - s)
            actions, f, b = [("F", s, i) for i in range(warmup)], warmup, 0
            while b < m:
                actions.append(("B", s, b))
                b += 1
                if f < m:
                    actions.append(("F", s, f))
                    f += 1
            out[s] = actions
        return out
    if resolved.single_stage:
        raise NotImplementedError(f"rank_actions: {resolved.schedule.__name__} is not modelled (GPipe, 1F1B and "
                                  "torch's multi-stage schedules are)")
    return torch_action_order(resolved)


def _ready(kind: str, stage: int, mb: int, done: dict, resolved: ResolvedPlan, links: list[float],
           m: int) -> float | None:
    """When the input of an action has arrived (``None``: its producer has not finished yet)."""
    if kind == "W":
        return done.get(("I", stage, mb))
    if kind == "F":
        if stage == 0:
            return 0.0
        producer, link = [("F", stage - 1, mb)], (stage - 1, stage)
    elif stage == resolved.num_stages - 1:
        return done.get(("F", stage, mb))
    else:  # B or I: the next stage's input grad
        producer, link = [("B", stage + 1, mb), ("I", stage + 1, mb)], (stage, stage + 1)
    end = next((done[p] for p in producer if p in done), None)
    if end is None:
        return None
    apart = resolved.stage_rank(link[0]) != resolved.stage_rank(link[1])
    return end + (links[link[0]] if apart else 0.0)


def _per_stage(values: Sequence[float], num_stages: int, name: str) -> list[float]:
    values = list(values)
    if len(values) != num_stages:
        raise ValueError(f"simulate_schedule: {name} has {len(values)} entries, the pipeline {num_stages} stages")
    if any(v < 0 for v in values):
        raise ValueError(f"simulate_schedule: {name} must not be negative, got {values}")
    return values
