"""What the job will hold on each rank for a layout, before launch: no process started, no parameter
allocated (the model is built on meta).

Each package answers for its own layout and the job only adds the answers up (the packages never
import each other; they meet in ``ndweave.mesh.contracts``' ``MemoryTerm``):

* ``ndweave.pipeline.cost``: the parameters each stage holds, the micro-batches its schedule keeps in
  flight;
* ``ndweave.dmodule.cost``: each parameter's local shape under the TP (or EP) plan, and the model
  itself sharded on meta, whose forward and backward of one micro-batch, run on meta over a fake
  process group, shows what tensor parallelism leaves saved for backward and the step's temporaries;
* ``ndweave.ddp.buffer.plan_buffers``: the parameter and grad buffers DDP lays the chunk out in,
  padding included (the function DDP itself calls);
* ``ndweave.optim.cost.state_bytes_per_rank``: AdamW's state and master weights for this rank's range
  of each bucket (the arithmetic ``DistributedOptimizer`` does);
* the job: its dataset, held whole by every rank.

    python examples/gpt/train.py --mesh pp=2,dp=2,tp=2 --estimate   # the table, nothing launched
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
from torch import nn

from data import TextData
from ndweave.ddp.buffer import plan_buffers
from ndweave.dmodule import get_plan
from ndweave.dmodule.cost import local_param_shapes, parallelize_on_meta
from ndweave.mesh import init_device_mesh, resolve_spec
from ndweave.mesh.contracts import MemoryTerm, RankMemory
from ndweave.mesh.testing import fake_world
from ndweave.mesh.testing.memory import TensorMemory
from ndweave.optim.cost import state_bytes_per_rank
from ndweave.pipeline import PipelineParallelPlan
from ndweave.pipeline.cost import held_saved_bytes, stage_activations, stage_param_names
from ndweave.pipeline.plan import resolve_plan

__all__ = ["estimate_memory", "table"]

DIMS = ("PP", "DP", "EP", "TP")
_TRACES = itertools.count()  # a fresh mesh dim name per trace (see _trace)


def estimate_memory(args: argparse.Namespace, build_model: Callable[..., nn.Module],
                    sharding: Callable[[nn.Module, dict[str, int]], dict | None], loss_fn: Callable, bucket_size: int,
                    optimizer_kwargs: dict) -> list[RankMemory]:
    """Every rank's estimated peak for ``args.mesh`` (sizes resolved without a world: no ``-1``), one
    :class:`RankMemory` per coordinate, in rank order. ``build_model(args, "meta")`` is the job's
    model on meta, ``sharding(model, sizes)`` its TP (or EP) plan for the mesh's sizes, or ``None``."""
    sizes = resolve_spec(args.mesh, None, dims=DIMS)
    pp, dp, ep, tp = (sizes[d] for d in DIMS)
    model = build_model(args, "meta")
    plan = PipelineParallelPlan(schedule_type=args.schedule, virtual_chunks=args.virtual_chunks,
                                num_microbatches=args.micro_batches)
    resolved = resolve_plan(plan, pp)
    rows = args.global_batch // (dp * ep * args.micro_batches)
    example = torch.zeros((rows, args.block_size), dtype=torch.long, device="meta")
    names = stage_param_names(model, plan, pp, example_inputs=example)
    plan_dict = sharding(model, sizes)
    data = _data_bytes(args)
    # one micro-batch's activations per stage, traced once: the TP peers' differ only by an uneven
    # vocabulary's last row block
    traced = _trace(build_model(args, "meta"), plan, example, plan_dict, sizes, loss_fn)
    ranks = []
    for coordinate in _coordinates(sizes):
        shapes = _local_shapes(model, plan_dict, sizes, coordinate)
        activations = _activation_terms(resolved, traced, coordinate)
        terms = [MemoryTerm("data", data, "job")]
        for stage in resolved.stages_of(coordinate["PP"]):
            terms += _model_state_terms(model, names[stage], shapes, sizes, coordinate, bucket_size, optimizer_kwargs)
        terms += activations
        ranks.append(RankMemory(coordinate, tuple(terms)))
    return ranks


def _coordinates(sizes: dict[str, int]) -> list[dict[str, int]]:
    """Every coordinate of the mesh, row-major (rank order)."""
    out = [{}]
    for d in DIMS:
        out = [{**c, d: i} for c in out for i in range(sizes[d])]
    return out


def _local_shapes(model: nn.Module, sharding: dict | None, sizes: dict[str, int],
                  coordinate: dict[str, int]) -> dict[str, list[torch.Size]]:
    """``{fqn: [local shape on each TP peer]}`` (a tied parameter under each of its names), this
    rank's first: a buffer slot is as large as the largest peer's shard (``slot_numel``)."""
    mesh = {"EP": sizes["EP"], "TP": sizes["TP"]} if sizes["EP"] > 1 else {"TP": sizes["TP"]}
    at = {d: coordinate[d] for d in mesh}
    peers = [local_param_shapes(model, sharding, mesh, {**at, "TP": t})
             for t in [at["TP"]] + [t for t in range(sizes["TP"]) if t != at["TP"]]]
    first = {id(p): n for n, p in model.named_parameters()}
    return {n: [s[first[id(p)]] for s in peers] for n, p in model.named_parameters(remove_duplicate=False)}


def _model_state_terms(model: nn.Module, names: list[str], shapes: dict[str, list[torch.Size]], sizes: dict[str, int],
                       coordinate: dict[str, int], bucket_size: int, optimizer_kwargs: dict) -> list[MemoryTerm]:
    """One stage chunk's parameters and grads (DDP's buffers), optimizer state and masters (ZeRO-1)."""
    dp, ep = sizes["DP"], sizes["EP"]
    params = []
    for n in names:
        p = model.get_parameter(n)
        local, *_ = shapes[n]
        expert = ep > 1 and local != p.shape  # sharded over EP: reduced over DP only; dense over DP x EP
        group, size = ("DP", dp) if expert or ep == 1 else ("DPxEP", dp * ep)
        params.append((n, p.dtype, local.numel(), max(s.numel() for s in shapes[n]), group, size))
    buffers = plan_buffers(params, bucket_size=bucket_size,
                           grad_dtype_of=lambda dt: torch.promote_types(dt, torch.float32))
    state = masters = 0
    for buffer in buffers:
        rank_in_group = coordinate["DP"] if buffer.data_parallel_size == dp else coordinate["DP"] * ep + coordinate["EP"]
        layout = [(b.end - b.start, [(offset, n) for _, offset, n in b.entries]) for b in buffer.buckets]
        opt = state_bytes_per_rank(layout, data_parallel_size=buffer.data_parallel_size, dp_rank=rank_in_group,
                                   param_dtype=buffer.param_dtype, optimizer=torch.optim.AdamW,
                                   optimizer_kwargs=optimizer_kwargs)
        state, masters = state + opt.state, masters + opt.masters
    return [MemoryTerm("parameters", sum(b.param_bytes() for b in buffers), "ddp"),
            MemoryTerm("gradients", sum(b.grad_bytes() for b in buffers), "ddp"),
            MemoryTerm("optimizer state", state, "optim"),
            MemoryTerm("master weights", masters, "optim")]


def _trace(model: nn.Module, plan: PipelineParallelPlan, example: torch.Tensor, sharding: dict | None,
           sizes: dict[str, int], loss_fn: Callable) -> list:
    """One micro-batch's activations on every stage as TP rank 0 runs them: forward and backward on
    meta, the TP plan applied over a fake world of the TP size. The mesh's dim gets a name of its own
    per trace: DTensor caches sharding decisions by mesh *value*, and an equal mesh of an earlier
    (destroyed) fake world would bring back its process groups."""
    if sizes["EP"] > 1:
        raise NotImplementedError("--estimate with ep > 1: routing tokens to experts needs their values (no meta "
                                  "kernel for bincount), so the experts' activations are not traced yet")
    if sizes["TP"] == 1:
        return stage_activations(model, plan, sizes["PP"], example, loss_fn=loss_fn)
    with fake_world(sizes["TP"], rank=0):
        name = f"TP{next(_TRACES)}"
        mesh = init_device_mesh("cpu", (sizes["TP"],), mesh_dim_names=(name,))[name]
        return stage_activations(model, plan, sizes["PP"], example, loss_fn=loss_fn,
                                 prepare=lambda chunk: parallelize_on_meta(chunk, mesh, sharding))


def _activation_terms(resolved, traced: list, coordinate: dict[str, int]) -> list[MemoryTerm]:
    """What the rank's stages keep for backward at the schedule's peak, plus the temporaries of one
    micro-batch's forward and backward on top."""
    stages = resolved.stages_of(coordinate["PP"])
    saved = held_saved_bytes(resolved, coordinate["PP"], [one.saved_bytes for one in traced])
    temporary = max(traced[s].peak_bytes - traced[s].saved_bytes for s in stages)
    return [MemoryTerm("activations", saved, "pipeline", persistent=False),
            MemoryTerm("temporaries", temporary, "pipeline", persistent=False)]


def _data_bytes(args: argparse.Namespace) -> int:
    """The dataset every rank holds (its tensors, once per storage)."""
    with TensorMemory() as memory:
        data = TextData(args.block_size, args.seed)
        held = memory.current_bytes()
    del data
    return held


def table(ranks: list[RankMemory]) -> str:
    """The estimate as text: a row per rank, a column per term (MiB), the peak last."""
    names = list(dict.fromkeys(t.name for r in ranks for t in r.terms))
    head = "rank  " + "  ".join(f"{d}" for d in DIMS) + "  " + "  ".join(f"{n:>15}" for n in names) + "      peak MiB"
    rows = [head]
    for i, r in enumerate(ranks):
        terms = r.by_name()
        rows.append(f"{i:>4}  " + "  ".join(f"{r.coordinate[d]:>2}" for d in DIMS) + "  "
                    + "  ".join(f"{terms.get(n, 0) / 2**20:>15.2f}" for n in names) + f"  {r.peak / 2**20:>12.2f}")
    return "\n".join(rows)
