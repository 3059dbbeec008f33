"""The model of the pipeline's own layout for a memory estimate: which parameters each stage holds,
from a model built on meta, with no process and no allocation.

It runs the cut ``construct_pipeline_stage`` runs (``construct.cut_model``) and builds each stage's
chunk (a skeleton copy sharing the model's tensors), so the answer is the chunks' own parameters:
a weight tied across stages is on each of them. ``tests/pipeline/test_pipeline_cost.py`` checks it
against real stages.
"""

from __future__ import annotations

import torch
from torch import nn

from ndweave.pipeline.construct import cut_model
from ndweave.pipeline.plan import PipelineParallelPlan, resolve_plan

__all__ = ["stage_param_names"]


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
