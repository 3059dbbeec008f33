"""``--mesh auto``: the layout the job runs, chosen before launch by ``ndweave.plan.layouts`` from the
job's own estimates (memory: :mod:`estimate`, step time: :mod:`step_time`).

The planner enumerates the layouts the model and batch allow; the job adds its own rules (what
``check_mesh`` and the pipeline refuse), prices each valid layout and keeps the fastest that fits
``--memory-per-device``. The chosen layout becomes ordinary flags (``--mesh pp=2,dp=2,tp=2
--schedule 1f1b --micro-batches 4 ...``), so a launched rank runs it exactly as if it had been typed.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Callable

import torch
from torch import nn

from ndweave.plan.layouts import Layout, ModelShape, Planned, plan_layout
from ndweave.pipeline import PipelineParallelPlan
from ndweave.pipeline.plan import resolve_plan
from ndweave_gpt.config import JobConfig

__all__ = ["choose_layout", "layout_args", "layout_flags", "memory_per_device", "model_shape", "world_size"]

#: The schedules ``--mesh auto`` tries, with their stages per PP rank.
SCHEDULES = {"1f1b": (1,), "gpipe": (1,), "interleaved_1f1b": (2,), "zero_bubble": (2,)}


def world_size(args: JobConfig) -> int:
    """The ranks ``--mesh auto`` plans for: ``--world-size``, else torchrun's ``WORLD_SIZE``, else the
    visible GPUs (``--device cuda``), else 8 CPU ranks."""
    if args.plan.world_size:
        return args.plan.world_size
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if args.parallel.device.startswith("cuda"):
        return torch.cuda.device_count()
    return 8


def memory_per_device(args: JobConfig, world: int) -> int:
    """Bytes each rank may hold: ``--memory-per-device`` (GiB), else a GPU's memory, else the host's
    available memory shared by the ``world`` ranks."""
    if args.plan.memory_per_device:
        return int(args.plan.memory_per_device * 2**30)
    if args.parallel.device.startswith("cuda"):
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // world


def model_shape(model: nn.Module, args: JobConfig, experts: int) -> ModelShape:
    """The layers, heads, experts and sequence length the layouts must divide."""
    c = args.model.hf_config
    if c is None:
        return ModelShape(num_layers=args.model.n_layer, num_heads=args.model.n_head, num_experts=experts,
                          seq_len=args.model.block_size)
    return ModelShape(num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                      num_kv_heads=getattr(c, "num_key_value_heads", None), num_experts=experts,
                      seq_len=args.model.block_size)


def layout_args(args: JobConfig, layout: Layout) -> JobConfig:
    """A copy of ``args`` that runs ``layout``."""
    return args.replace(mesh=layout.spec(), schedule=layout.schedule, virtual_chunks=layout.virtual_chunks,
                        micro_batches=layout.micro_batches, activation_checkpointing=layout.recompute,
                        zero_stage=layout.zero_stage)


def layout_flags(layout: Layout) -> list[str]:
    """``layout`` as the job's flags (what replaces ``--mesh auto`` on the launched ranks' command line)."""
    flags = ["--mesh", layout.spec(), "--schedule", layout.schedule, "--virtual-chunks", str(layout.virtual_chunks),
             "--micro-batches", str(layout.micro_batches), "--zero-stage", str(layout.zero_stage)]
    return flags + (["--activation-checkpointing"] if layout.recompute else [])


def choose_layout(args: JobConfig, shape: ModelShape, world: int, budget: int,
                  peak_bytes: Callable[[JobConfig], int], step_seconds: Callable[[JobConfig], float],
                  job_rule: Callable[[JobConfig], str | None],
                  price_ahead: Callable[[list[JobConfig], int], None] | None = None) -> Planned:
    """The fastest layout of ``world`` ranks whose every rank fits ``budget`` bytes: ``peak_bytes`` and
    ``step_seconds`` price a layout's args; ``job_rule`` says what the job cannot run (or None);
    ``price_ahead(args of every valid layout, budget)``, if given, is called before any is priced
    (``proxy.Pricer.price_ahead``: in parallel)."""
    def rule(layout: Layout) -> str | None:
        if layout.pp > 1:
            plan = PipelineParallelPlan(schedule_type=layout.schedule, virtual_chunks=layout.virtual_chunks,
                                        num_microbatches=layout.micro_batches)
            try:
                resolve_plan(plan, layout.pp)
            except ValueError as error:
                return f"the schedule refuses it: {error}"
        return job_rule(layout_args(args, layout))

    def estimate(layout: Layout) -> tuple[int, float]:
        chosen = layout_args(args, layout)
        peak = peak_bytes(chosen)
        return peak, step_seconds(chosen) if peak <= budget else math.inf  # a layout that does not fit is cut unpriced

    rows = args.data.global_batch
    counts = [m for m in (1, 2, 4, 8, 16) if m <= rows]  # beyond 16 micro-batches a step only slows
    def prepare(layouts: list[Layout]) -> None:
        if price_ahead is not None:
            price_ahead([layout_args(args, layout) for layout in layouts], budget)

    with _collector_skips_what_exists():
        return plan_layout(world, budget, args.data.global_batch, shape, estimate=estimate, schedules=SCHEDULES,
                           micro_batches=counts, check=rule, prepare=prepare)


@contextlib.contextmanager
def _collector_skips_what_exists():
    """Pricing makes many short-lived objects, and the full collections they set off would walk every
    object the process already holds (the meta model, torch's and transformers' modules) each time:
    about 1 s of a 70B plan on 2 cores. Those are frozen meanwhile (``gc.freeze``), unless the process
    froze objects of its own (``gc.unfreeze`` would thaw them too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
