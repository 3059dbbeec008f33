"""The model of the pipeline's own layout for a memory estimate: which parameters each stage holds,
and the activations its micro-batches keep for backward, from a model built on meta, with no process
and no allocation.

It runs the cut ``construct_pipeline_stage`` runs (``construct.cut_model``) and builds each stage's
chunk (a skeleton copy sharing the model's tensors), so the answer is the chunks' own parameters:
a weight tied across stages is on each of them. ``tests/pipeline/test_pipeline_cost.py`` checks it
against real stages.
"""

from __future__ import annotations

import torch
from torch import nn

from ndweave.pipeline.construct import cut_model
from ndweave.pipeline.plan import PipelineParallelPlan, ResolvedPlan, resolve_plan
from ndweave.pipeline.program import stage_program
from ndweave.pipeline.report import count_saved_bytes

__all__ = ["microbatches_in_flight", "saved_bytes_by_stage", "stage_param_names"]


def stage_param_names(model: nn.Module, plan: PipelineParallelPlan, pp_size: int, *,
                      example_inputs: torch.Tensor | tuple | None = None) -> list[list[str]]:
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
                         example_inputs: torch.Tensor | tuple) -> list[int]:
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
    values = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    saved = []
    with torch.enable_grad():
        for stage in range(resolved.num_stages):
            chunk = cut.chunk(model, stage)
            with count_saved_bytes(chunk) as counted:
                chunk(*values)
            saved.append(counted[0])
            # what the next stage receives: a fresh buffer there, as a P2P receive makes it
            values = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in stage_program(chunk).sent)
    return saved


def microbatches_in_flight(resolved: ResolvedPlan, stage: int) -> int:
    """The most micro-batches whose activations ``stage`` holds at once under the plan's schedule (a
    micro-batch is held from its forward to its backward): GPipe runs every forward first, so all of
    them; 1F1B starts backward after ``pp_size - stage`` forwards. Other schedules are not modelled
    yet (``NotImplementedError``); ``engine.stage_report()`` measures any of them."""
    name, m = resolved.schedule.__name__, resolved.num_microbatches
    if name == "ScheduleGPipe":
        return m
    if name == "Schedule1F1B":
        return min(m, resolved.pp_size - stage)
    raise NotImplementedError(f"microbatches_in_flight: {resolved.plan.schedule_type!r} is not modelled yet "
                              "(GPipe and 1F1B are); measure it with engine.stage_report()")
