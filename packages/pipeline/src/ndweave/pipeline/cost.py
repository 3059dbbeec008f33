"""The model of the pipeline's own layout for a memory estimate: which parameters each stage holds,
the activations one micro-batch keeps for backward on each stage, and how many micro-batches a stage
holds at once under the plan's schedule, from a model built on meta, with no process and no allocation.

It runs the cut ``construct_pipeline_stage`` runs (``construct.cut_model``) and builds each stage's
chunk (a skeleton copy sharing the model's tensors), so the answer is the chunks' own parameters:
a weight tied across stages is on each of them. The micro-batches in flight come from the order in
which torch's schedule runs its actions (torch's own action lists for the multi-stage schedules).
``tests/pipeline/test_pipeline_cost.py`` checks all of it against real stages and the peaks
``engine.stage_report()`` measures.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, Schedule1F1B, ScheduleGPipe

from ndweave.mesh import torch_compat
from ndweave.pipeline.construct import ModelCut, cut_model
from ndweave.pipeline.inputs import ModelInputs, split_inputs
from ndweave.pipeline.stage_io import first_tensor
from ndweave.pipeline.plan import PipelineParallelPlan, ResolvedPlan, resolve_plan
from ndweave.pipeline.program import stage_program
from ndweave.pipeline.report import count_saved_bytes

__all__ = ["StageActivations", "held_saved_bytes", "microbatches_in_flight", "receive_buffer_bytes", "saved_bytes_by_stage",
           "stage_activations", "stage_param_names", "torch_action_order"]


def stage_param_names(model: nn.Module, plan: PipelineParallelPlan, pp_size: int, *,
                      example_inputs: ModelInputs | None = None) -> list[list[str]]:
    """The FQNs of the parameters each stage holds (index: stage; a tied weight under each FQN its
    stage uses) when ``construct_pipeline_stage(model, plan, mesh, example_inputs=...)`` runs over a
    PP dim of ``pp_size`` ranks. PP rank ``r`` holds the stages ``resolve_plan(plan, pp_size).stages_of(r)``
    (``virtual_chunks`` of them). ``split_method="time"`` measures layers, so it needs ``split_points``
    here. Example::

        with torch.device("meta"):
            model = GPT(config)
        names = stage_param_names(model, PipelineParallelPlan(schedule_type="gpipe"), 2,
                                  example_inputs=torch.zeros(2, 64, dtype=torch.long, device="meta"))
        names[1]   # ['transformer.h.2.ln_1.weight', ..., 'lm_head.weight']
    """
    if plan.split_points is None and plan.split_method == "time":
        raise ValueError("stage_param_names: split_method='time' times the layers on a device; give the plan "
                         "split_points (e.g. those a timed construct_pipeline_stage chose) or use 'uniform'")
    resolved = resolve_plan(plan, pp_size)
    cut = cut_model(model, plan, resolved, example_inputs, "meta")
    return [[fqn for fqn, _ in cut.chunk(model, stage).named_parameters()] for stage in range(resolved.num_stages)]


def saved_bytes_by_stage(model: nn.Module, plan: PipelineParallelPlan, pp_size: int,
                         example_inputs: ModelInputs) -> list[int]:
    """The bytes one micro-batch's forward saves for backward on each stage (index: stage), counted as
    the engine's ``stage_report`` counts them (every tensor autograd saves, once per storage,
    parameters left out), with ``example_inputs`` one micro-batch on meta. The stages' forwards run
    one after the other on meta under autograd's saved-tensor hooks: what autograd itself saves for
    the ops the model runs, at their real shapes, with no compute. The loss (computed after the last
    stage's forward) is not counted, nor is recompute (``activation_recompute`` saves only a stage's
    inputs). Example::

        with torch.device("meta"):
            model = GPT(config)
            per_stage = saved_bytes_by_stage(model, PipelineParallelPlan(), 2, torch.zeros(4, 64, dtype=torch.long))
    """
    resolved = resolve_plan(plan, pp_size)
    cut = cut_model(model, plan, resolved, example_inputs, "meta")
    if cut.traced is None:
        raise ValueError("saved_bytes_by_stage: pass example_inputs (the traced cut's stages hand each other values)")
    args, kwargs = split_inputs(example_inputs)
    saved = []
    with torch.enable_grad():
        for stage in range(resolved.num_stages):
            chunk = cut.chunk(model, stage)
            with count_saved_bytes(chunk) as counted:
                chunk(*args, **kwargs)
            saved.append(counted[0])
            # what the next stage receives: a fresh buffer there, as a P2P receive makes it
            args, kwargs = tuple(t.detach().clone().requires_grad_(t.is_floating_point())
                                 for t in stage_program(chunk).sent), {}
    return saved


def microbatches_in_flight(resolved: ResolvedPlan, stage: int) -> int:
    """The most micro-batches whose activations ``stage`` holds at once under the plan's schedule;
    times ``saved_bytes_by_stage(...)[stage]`` it is the peak ``engine.stage_report()`` measures
    (``peak_activation_bytes``). A micro-batch is held from its forward until the backward that
    frees what the forward saved: a full backward (``B``), or with split backward (zero bubble, ZBV,
    DualPipeV) the weight-grad backward (``W``), not the input-grad one (``I``): torch runs ``I``
    with ``retain_graph=True`` and keeps the graph nodes ``W`` starts from, which reach every node
    down to the stage's inputs, so after ``I`` autograd still holds every tensor the forward saved
    (measured on the GPT: 100% after ``I``, none after ``W``). Per schedule:

    * ``gpipe``: every forward first, so all ``num_microbatches``;
    * ``1f1b``: ``min(num_microbatches, pp_size - stage)`` (torch warms up with that many forwards,
      then alternates backward and forward);
    * the multi-stage schedules (``interleaved_1f1b``, ``looped_bfs``, ``zero_bubble``,
      ``zbv_zero_bubble``, ``dualpipev``): counted along the action list torch builds for each PP
      rank and runs in that order, so no formula of ours can drift from torch's schedule.

    Each stage is counted on its own: two stages of one PP rank may peak at different times, so the
    sum of their peaks bounds the rank's peak from above. Example::

        resolved = resolve_plan(PipelineParallelPlan(schedule_type="zero_bubble", virtual_chunks=2,
                                                     num_microbatches=8), 2)
        [microbatches_in_flight(resolved, s) for s in range(resolved.num_stages)]   # [4, 4, 2, 2]
    """
    if not 0 <= stage < resolved.num_stages:
        raise ValueError(f"microbatches_in_flight: stage {stage} is not in 0..{resolved.num_stages - 1}")
    return _in_flight(resolved.schedule, resolved.pp_size, resolved.num_stages, resolved.num_microbatches,
                      tuple(resolved.stages_of(0)))[stage]


@functools.cache
def _in_flight(schedule: type, pp_size: int, num_stages: int, num_microbatches: int,
               rank0_stages: tuple[int, ...]) -> tuple[int, ...]:
    """Each stage's peak count of held micro-batches (cached: an estimate asks once per stage)."""
    m = num_microbatches
    # torch's single-stage schedules run loops of their own (``_step_microbatches``); the action list
    # they build is only a picture (1F1B's warms up with one forward fewer than its loop)
    if schedule is ScheduleGPipe:
        return (m,) * num_stages
    if schedule is Schedule1F1B:
        return tuple(min(m, pp_size - stage) for stage in range(num_stages))
    if not issubclass(schedule, PipelineScheduleMulti):
        raise NotImplementedError(f"microbatches_in_flight: {schedule.__name__} is not modelled (GPipe, 1F1B and "
                                  "torch's multi-stage schedules are); measure it with engine.stage_report()")
    held, peak = [0] * num_stages, [0] * num_stages
    for actions in _action_order(schedule, pp_size, num_stages, m, rank0_stages).values():
        for kind, stage, _ in actions:
            if kind == "F":
                held[stage] += 1
                peak[stage] = max(peak[stage], held[stage])
            elif kind in ("B", "W"):  # "I" frees nothing: see microbatches_in_flight
                held[stage] -= 1
    return tuple(peak)


def torch_action_order(resolved: ResolvedPlan) -> dict[int, list[tuple[str, int, int]]]:
    """Each PP rank's compute actions ``(kind, stage, micro_batch)`` in the order torch's multi-stage
    schedule runs them (kind ``"F"``, ``"B"``, ``"I"`` or ``"W"``, as ``engine.timeline()`` records
    them; DualPipeV's overlapped forward-backward as its two actions, in the order torch runs them)::

        torch_action_order(resolve_plan(PipelineParallelPlan(schedule_type="zbv_zero_bubble",
                                                             virtual_chunks=2, num_microbatches=4), 2))[0][:4]
        # [('F', 0, 0), ('F', 0, 1), ('F', 0, 2), ('F', 3, 0)]

    It is torch's ``pipeline_order_with_comms``, less the communication. Every rank builds the whole
    list, so the schedule is built once, with no process group, on stand-ins for rank 0's stages
    (the fields torch's constructors read). GPipe and 1F1B raise ``ValueError``: torch runs them
    with loops of their own, not from such a list."""
    if not issubclass(resolved.schedule, PipelineScheduleMulti):
        raise ValueError(f"torch_action_order: {resolved.plan.schedule_type!r} runs one stage per rank by a loop of "
                         "torch's own, not from an action list")
    order = _action_order(resolved.schedule, resolved.pp_size, resolved.num_stages, resolved.num_microbatches,
                          tuple(resolved.stages_of(0)))
    return {rank: list(actions) for rank, actions in order.items()}


@functools.cache
def _action_order(schedule: type, pp_size: int, num_stages: int, num_microbatches: int,
                  rank0_stages: tuple[int, ...]) -> dict[int, tuple[tuple[str, int, int], ...]]:
    # what torch's constructors read of a stage: its index and the pipeline's shape (no process group
    # needed: every rank computes every rank's list), and ``submod`` (zero bubble's torch.compile check)
    stages = [types.SimpleNamespace(num_stages=num_stages, group_size=pp_size, group_rank=0, stage_index=stage,
                                    submod=None)
              for stage in rank0_stages]
    try:
        built = schedule(stages, n_microbatches=num_microbatches)
        listed = built.pipeline_order_with_comms
    except (AttributeError, TypeError) as missing:  # a torch whose schedules read more of a stage
        raise NotImplementedError(f"{schedule.__name__} could not be built on stand-in stages with this torch "
                                  f"({missing}); measure the peak with engine.stage_report()") from missing
    order = {}
    for rank, actions in listed.items():
        flat = [sub for action in actions for sub in (action.sub_actions or (action,))]
        order[rank] = tuple((a.computation_type.value, a.stage_index, a.microbatch_index) for a in flat
                            if a.computation_type.value in ("F", "B", "I", "W"))
    return order


@dataclass(frozen=True)
class StageActivations:
    """One micro-batch's activation memory on one stage."""

    saved_bytes: int
    """What its forward saves for backward (held until its backward frees it), as
    :func:`saved_bytes_by_stage` counts it."""
    peak_bytes: int
    """The most bytes its forward and backward (the loss's, on the last stage) held at once beyond
    the parameters: the saved tensors plus the temporaries of the op running at the peak."""


def stage_activations(model: nn.Module, plan: PipelineParallelPlan, pp_size: int, example_inputs: ModelInputs,
                      *, prepare: Callable[[nn.Module], nn.Module] | None = None,
                      loss_fn: Callable[..., torch.Tensor] | None = None,
                      cut: ModelCut | None = None) -> list[StageActivations]:
    """Each stage's :class:`StageActivations` for one micro-batch (``example_inputs``, on meta), its
    forward and backward run on meta under torch's tensor-memory tracker, nothing allocated.

    ``prepare(chunk)`` returns the chunk as a rank runs it, e.g. sharded by
    ``ndweave.dmodule.cost.parallelize_on_meta`` inside ``fake_world`` (tensor parallelism changes
    what is saved); the next stage receives what it sends. Each parameter's grad is dropped as it
    lands, as a data-parallel wrapper moves it into its own buffer. The last stage's backward starts
    from ``loss_fn(output, targets)`` (targets: zeros shaped like the first input), else from the
    output's sum. ``cut``: where ``model`` is cut, from an earlier ``cut_model`` of a model of the same
    structure, ``plan`` and ``example_inputs`` shapes (stages are named by FQN: a copy of that model will
    do, before TP is applied), to spare tracing the forward once more for the cut. Example::

        per_stage = stage_activations(meta_model, PipelineParallelPlan(), 2, torch.zeros(4, 64, dtype=torch.long,
                                      device="meta"), loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    """
    resolved = resolve_plan(plan, pp_size)
    cut = cut if cut is not None else cut_model(model, plan, resolved, example_inputs, "meta")
    if len(cut.stage_layers) != resolved.num_stages:
        raise ValueError(f"stage_activations: the cut passed has {len(cut.stage_layers)} stages, the plan "
                         f"{resolved.num_stages}; cut the model under this plan")
    if cut.traced is None:
        raise ValueError("stage_activations: pass example_inputs (the traced cut's stages hand each other values)")
    args, kwargs = split_inputs(example_inputs)
    first = first_tensor((*args, *kwargs.values()))
    out = []
    with torch.enable_grad():
        for stage in range(resolved.num_stages):
            chunk = cut.chunk(model, stage)
            chunk = prepare(chunk) if prepare is not None else chunk
            hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in chunk.parameters() if p.requires_grad]
            with torch_compat.TensorMemory() as memory, count_saved_bytes(chunk) as counted:
                # the tracker counts a storage made before it started once an op returns a view of it
                # (a linear's ``t()`` of its weight): the parameters are counted up front and left out
                # of the peak, the inputs (which the stage's forward may save) kept in it
                memory.track_external(chunk)
                before = memory.current_bytes("meta")
                memory.track_external(*[t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)])
                output = chunk(*args, **kwargs)
                sent = stage_program(chunk).sent
                if stage == resolved.num_stages - 1 and loss_fn is not None:
                    loss_fn(first_tensor(output), torch.zeros_like(first)).backward()  # as the engine calls it
                else:
                    outputs = [t for t in sent if t.requires_grad]
                    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            for hook in hooks:
                hook.remove()
            out.append(StageActivations(counted[0], memory.peak_bytes("meta") - before))
            # what the next stage receives: a fresh buffer there, as a P2P receive makes it
            args, kwargs = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in sent), {}
    return out


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def held_saved_bytes(resolved: ResolvedPlan, pp_rank: int, saved_bytes: Sequence[int]) -> int:
    """The most bytes of saved activations PP rank ``pp_rank`` holds at once under the schedule,
    given one micro-batch's ``saved_bytes`` per stage (index: stage): its stages' held micro-batches
    added up at each action, in the order torch runs them, which can be less than the sum of each
    stage's own peak (stages of one rank peak at different times)."""
    stages = resolved.stages_of(pp_rank)
    if not issubclass(resolved.schedule, PipelineScheduleMulti):
        return sum(saved_bytes[s] * microbatches_in_flight(resolved, s) for s in stages)
    held = peak = 0
    for kind, stage, _ in torch_action_order(resolved)[pp_rank]:
        if kind == "F":
            held += saved_bytes[stage]
            peak = max(peak, held)
        elif kind in ("B", "W"):  # "I" frees nothing: see microbatches_in_flight
            held -= saved_bytes[stage]
    return peak


def receive_buffer_bytes(resolved: ResolvedPlan, pp_rank: int, received: Sequence[int], sent: Sequence[int]) -> int:
    """Bytes of the buffers torch's pipeline stages on PP rank ``pp_rank`` receive into: a buffer per
    micro-batch, allocated at the first step and kept for the run, for the activations from the stage
    before (``received[s]``: one micro-batch's inputs of stage ``s``, 0 on the first stage) and for the
    grads of the activations it sends the stage after (``sent[s]``: its outputs; none on the last)."""
    last, m = resolved.num_stages - 1, resolved.num_microbatches
    return sum(m * (received[s] + (sent[s] if s < last else 0)) for s in resolved.stages_of(pp_rank))
