"""How long one training step of a layout takes, before launch: no process started, nothing
allocated (the model is traced on meta), with the machine's rates measured once
(``ndweave.plan.calibrate``).

What a step asks for comes from the packages that run it, as the memory estimate's terms do
(``estimate.py``), and ``ndweave.plan.calibrate.Machine`` turns each into seconds:

* compute, per stage and micro-batch: one micro-batch's forward and backward traced on meta
  (``ndweave.pipeline.cost.stage_activations``, TP applied by ``ndweave.dmodule.cost.parallelize_on_meta``
  over a fake world) under a ``WorkCounter``: matmul FLOPs, elementwise bytes and ops per rank, and
  the bytes of each TP collective DTensor issues (with experts over EP: the token dispatch's
  all-to-alls, the routing balanced on meta);
* each action's host time beyond its ops: the engine's (``ACTION_HOST_OPS`` ops' worth) and, on CPU,
  a message's latency per neighbouring stage on another rank;
* the schedule: ``ndweave.pipeline.step_time.simulate_schedule`` runs the actions in torch's order
  with those times, activations crossing to another rank over the link;
* the data-parallel grad sync: a reduce-scatter (on CPU, where gloo does it in place, an all-reduce)
  of every grad bucket (with ZeRO-2, per micro-batch) and an all-gather of its
  parameters after the step, over the bucket's group (DP; DP x EP for a MoE model's dense
  parameters), from the buckets DDP lays out
  (``ndweave.ddp.buffer.plan_buffers``, the function DDP calls); the grads tensor parallelism leaves
  partial (replicated parameters') are all-reduced over TP;
* the optimizer: AdamW and the grad clip over this rank's owned runs of each bucket (one flat master
  each: ``ndweave.optim.cost.owned_runs``), run on meta under the counter;
* the job's own collectives per step (the engine's batch agreement and loss broadcast over PP, the
  loss mean over DP, DDP's desync check, the grad norm), their latency.

Ranks on CPU each run one thread; more ranks than cores share them (``Machine.concurrent_ranks``):
the schedule's ranks compute at ``cores / (dp * tp)`` pipelines' speed when more compute at once, and
the terms every rank runs together (grad sync, optimizer) take ``world / cores`` times as long.

    machine = calibrate(args.parallel.device, dtypes=[DTYPES[args.model.dtype]])
    step = estimate_step_seconds(args, machine, build_model, sharding, loss_fn, bucket_size, adamw_kwargs)
    print(table(step))          # a row per term; step.seconds is the step

What it misses, measured on 2 shared cores (``tests/integration/test_integration_step_time.py``): the
absolute step, by 1.5-4x (the order of layouts is what it is held to); sharing cores is modelled
as an even split, without the scheduler's wake-up delays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from ndweave.ddp.buffer import plan_buffers
from ndweave.dmodule.cost import local_param_shapes, parallelize_on_meta
from ndweave.mesh import resolve_spec
from ndweave.plan.calibrate import Machine
from ndweave.plan.work import Work, WorkCounter
from ndweave.plan.estimate import StepTime, TimeTerm
from ndweave.mesh.torch_compat import local_tensor, tree_flatten
from ndweave.optim.cost import owned_runs
from ndweave.pipeline import PipelineParallelPlan
from ndweave.pipeline.cost import stage_activations
from ndweave.pipeline.plan import resolve_plan
from ndweave.pipeline.step_time import simulate_schedule
from ndweave_gpt.config import DIMS, DTYPES, JobConfig
from ndweave_gpt.cost.estimate import fused_attention, parameters, traced_world
from ndweave_gpt.data import example_batch

__all__ = ["StageWork", "estimate_step_seconds", "first_shapes", "host_seconds", "named_group", "optimizer_seconds",
           "sharding_groups", "stage_buffers", "stage_work", "step_terms", "sync_and_optimizer", "table",
           "work_seconds"]

#: The pipeline engine's host time per action beyond the stage's own ops (torch's schedule loop,
#: posting and completing the stage's sends and receives, its input and output handling, the
#: engine's and DDP's hooks), in ops' worth of ``Machine.op_overhead_s``: a stage with next to no
#: compute runs a forward every 0.6-2 ms on the 2-core machine the tests run on, ~75-250 ops' worth.
#: 200: at 8 ranks on those 2 cores, 16 micro-batches of a pipeline over 8 cost 240-370 ms more a step
#: than 8 (``tests/integration/test_integration_step_time.py``), 1.6-2.4x what 200 predicts where the
#: whole steps run 1.6-3.3x their estimates; 100 priced the actions at half that share, and ranked a
#: pipeline over 8 ranks ahead of data parallel over 8, measured 5-16% faster.
ACTION_HOST_OPS = 200


def estimate_step_seconds(args: JobConfig, machine: Machine, build_model: Callable[..., nn.Module],
                          sharding: Callable[[nn.Module, dict[str, int]], dict | None], loss_fn: Callable,
                          bucket_size: int | None, optimizer_kwargs: dict) -> StepTime:
    """One training step of ``args.parallel.mesh`` (sizes resolved without a world: no ``-1``) on
    ``machine``, term by term (the module's docstring says how each is modelled). The arguments are
    :func:`estimate.estimate_memory`'s: ``build_model(args, "meta")`` is the job's model on meta,
    ``sharding(model, sizes)`` its TP plan for the mesh's sizes (or ``None``), ``bucket_size`` DDP's,
    ``optimizer_kwargs`` AdamW's. ``machine`` must rate ``--dtype``'s matmuls
    (``calibrate(device, dtypes=[...])``)."""
    sizes = resolve_spec(args.parallel.mesh, None, dims=DIMS)
    pp, dp, ep = sizes["PP"], sizes["DP"], sizes["EP"]
    plan = PipelineParallelPlan(schedule_type=args.parallel.schedule, virtual_chunks=args.parallel.virtual_chunks,
                                num_microbatches=args.parallel.micro_batches)
    resolved = resolve_plan(plan, pp)
    rows = args.data.global_batch // (dp * ep * args.parallel.micro_batches)
    example = example_batch(args, rows, "meta", sizes["CP"])  # --data: the document mask; cp: a CP rank's tokens
    traced = stage_work(build_model(args, "meta"), plan, example, sharding, sizes, loss_fn, args.parallel.device)
    dtype = DTYPES[args.model.dtype]
    groups, inside = sharding_groups(sizes), machine.within_host(sizes)
    local = groups.keys() & inside
    host = host_seconds(resolved, machine)
    forward = [work_seconds(w.forward, machine, dtype, groups, local) + host[s] for s, w in enumerate(traced)]
    backward = [work_seconds(w.backward, machine, dtype, groups, local) + host[s] for s, w in enumerate(traced)]
    links = [machine.collective_seconds("send", w.sent_bytes, 2, within_host="PP" in inside) for w in traced[:-1]]
    model = build_model(args, "meta")
    plan_dict = sharding(model, sizes)
    shapes = first_shapes(model, plan_dict, sizes)
    sync, optimizer = sync_and_optimizer(
        resolved, sizes, machine, lambda stage: stage_buffers(model, traced[stage].param_names, shapes, sizes, bucket_size),
        optimizer_seconds(machine, optimizer_kwargs, args.training.clip), args.parallel.zero_stage)
    tp_comm = max(machine.communication_seconds(w.forward + w.backward, groups, local) for w in traced)
    return step_terms(resolved, sizes, machine, forward, backward, links, sync, optimizer, tp_comm)


def sharding_groups(sizes: dict[str, int]) -> dict[str, int]:
    """The groups a stage's own collectives run over, by the names :func:`stage_work` gives them, and
    their sizes: TP's (DTensor's), or with ``ep > 1`` EP's (the token dispatch's all-to-alls; the job's
    MoE layouts have ``tp = 1``); and with ``cp > 1`` CP's (attention's keys and values)."""
    groups = {"EP": sizes["EP"]} if sizes["EP"] > 1 else {"TP": sizes["TP"]}
    return {**groups, "CP": sizes["CP"]} if sizes.get("CP", 1) > 1 else groups


def named_group(work: Work, name: str, names: dict[str, str] | None = None) -> Work:
    """``work`` with its collectives' groups named: ``names`` maps a fake world's group name to one of
    :func:`sharding_groups`' (CP's), every other group is ``name`` (priced for any size)."""
    names = names or {}
    return dataclasses.replace(work, collectives=[(kind, nbytes, names.get(group, name))
                                                  for kind, nbytes, group in work.collectives])


def step_terms(resolved, sizes: dict[str, int], machine: Machine, forward: list[float], backward: list[float],
               links: list[float], sync: float, optimizer: float, tp_comm: float) -> StepTime:
    """The step from each stage's forward and backward of one micro-batch (host time included), the
    links between stages, and the slowest PP rank's grad sync and optimizer step: the schedule
    simulated, every rank's terms slowed where CPU ranks share cores."""
    # EP ranks split the batch as DP ranks do, CP ranks its sequences: each is a pipeline of its own
    pp, dp, tp = sizes["PP"], sizes["DP"] * sizes["CP"] * sizes["EP"], sizes["TP"]
    world = pp * dp * tp
    shared = machine.device_type == "cpu" and world > machine.concurrent_ranks
    # more CPU ranks than cores: the dp * ep * tp pipelines run side by side, so a pipeline's ranks have
    # cores / (dp * ep * tp) ranks' speed between them; what every rank does at once takes world / cores as long
    concurrency = machine.concurrent_ranks / (dp * tp) if shared else None
    slowdown = world / machine.concurrent_ranks if shared else 1.0
    timeline = simulate_schedule(resolved, forward, backward, links, concurrency=concurrency)
    schedule = max(timeline.durations)
    inside = machine.within_host(sizes)
    # the engine's batch agreement and loss broadcast, the loss's mean, DDP's desync check, the grad norm
    bookkeeping = (2 * machine.collective_seconds("all_gather", 64, pp, within_host="PP" in inside)
                   + machine.collective_seconds("all_reduce", 8, dp, within_host="DP" in inside)
                   + machine.collective_seconds("all_gather", 40 * dp, dp, within_host="DP" in inside)
                   + machine.collective_seconds("all_reduce", 8, world, within_host="PP" in inside))
    busiest = max(range(resolved.num_stages), key=lambda s: forward[s] + backward[s])
    compute = max(sum(a.end - a.start for a in acts) for acts in timeline.ranks)
    return StepTime((
        TimeTerm("pipeline schedule", schedule, "pipeline"),
        TimeTerm("grad sync", sync * slowdown, "ddp"),
        TimeTerm("optimizer step", optimizer * slowdown, "optim"),
        TimeTerm("step collectives", bookkeeping * slowdown, "job"),
        TimeTerm("compute (busiest PP rank)", compute, "pipeline", in_total=False),
        TimeTerm("bubble", schedule - compute, "pipeline", in_total=False),
        TimeTerm(f"one micro-batch on stage {busiest}", forward[busiest] + backward[busiest], "pipeline",
                 in_total=False),
        TimeTerm(f"{'+'.join(sharding_groups(sizes))} collectives per micro-batch (busiest stage)", tp_comm,
                 "dmodule", in_total=False),
    ))


def work_seconds(work: Work, machine: Machine, dtype: torch.dtype, groups: dict[str, int],
                 within_host: Collection[str] = ()) -> float:
    """A stage's ``work`` (compute and its TP or EP collectives, over ``groups``: name -> ranks, as
    :func:`sharding_groups`; those named in ``within_host`` over the host's link) in seconds.
    Every op of a TP stage runs on DTensors (the counter sees their local ops: the memory tracker
    inside stage_activations steps aside for DTensor first, hiding the DTensor ops); EP's experts run
    on their local weights."""
    tensor_parallel = groups.get("TP", 1) > 1
    return (machine.compute_seconds(work, dtype, tensor_parallel=tensor_parallel)
            + machine.communication_seconds(work, groups, within_host))


def host_seconds(resolved, machine: Machine) -> list[float]:
    """Each stage's host time per action beyond its ops: the engine's (ACTION_HOST_OPS), and on CPU,
    where the link is the host, each message's latency on both ranks' processes (gloo's syscalls and
    wake-ups over loopback), once per neighbour on another rank."""
    per_message = machine.link_latency_s if machine.device_type == "cpu" else 0.0
    talks = [sum(0 <= n < resolved.num_stages and resolved.stage_rank(n) != resolved.stage_rank(s)
                 for n in (s - 1, s + 1)) for s in range(resolved.num_stages)]
    return [ACTION_HOST_OPS * machine.op_overhead_s + talks[s] * per_message for s in range(resolved.num_stages)]


def sync_and_optimizer(resolved, sizes: dict[str, int], machine: Machine, buffers_of: Callable[[int], tuple[list, int]],
                       optimizer: Callable[[int, int, torch.dtype], float], zero_stage: int = 1) -> tuple[float, float]:
    """The slowest PP rank's grad sync (every bucket reduced, on CPU all-reduced, and its parameters all-gathered
    over its group: DP, or DP x EP for the dense parameters of a MoE model over EP; TP's partial grads
    all-reduced) and optimizer step (its owned runs of every bucket, one
    step: ``optimizer(runs, elements, param_dtype)``, :func:`optimizer_seconds`). ``buffers_of(stage)``:
    DDP's buffers of the stage's chunk and its TP-replicated grad bytes (:func:`stage_buffers`). With
    ``zero_stage=2`` every micro-batch's backward reduces its buckets (no full-size buffer keeps a
    local sum): ``m`` reductions a step."""
    reductions = resolved.num_microbatches if zero_stage >= 2 else 1
    # gloo all-reduces a bucket in place where NCCL reduce-scatters it (ndweave.ddp.sync.reduces_by_all_reduce)
    reduce = "all_reduce" if machine.device_type == "cpu" else "reduce_scatter"
    tp = sizes["TP"]
    inside = machine.within_host(sizes)  # DP within a host: DP x EP too (EP lies inside DP)
    sync = slowest = 0.0
    for pp_rank in range(resolved.pp_size):
        rank_sync, owned = 0.0, {}
        for stage in resolved.stages_of(pp_rank):
            buffers, replicated = buffers_of(stage)
            for buffer in buffers:
                runs, elements = owned.get(buffer.param_dtype, (0, 0))
                dp = buffer.data_parallel_size
                for b in buffer.buckets:
                    numel = b.end - b.start
                    rank_sync += reductions * machine.collective_seconds(
                        reduce, numel * buffer.grad_dtype.itemsize, dp, within_host="DP" in inside)
                    rank_sync += machine.collective_seconds("all_gather", numel * buffer.param_dtype.itemsize, dp,
                                                            within_host="DP" in inside)
                    mine = owned_runs(numel, [(offset, n) for _, offset, n in b.entries], dp, 0)
                    runs, elements = runs + len(mine), elements + sum(mine)
                owned[buffer.param_dtype] = (runs, elements)
            rank_sync += machine.collective_seconds("all_reduce", replicated, tp, within_host="TP" in inside)
        sync = max(sync, rank_sync)
        slowest = max(slowest, sum(optimizer(runs, n, dtype) for dtype, (runs, n) in owned.items() if runs))
    return sync, slowest

@dataclass(frozen=True)
class StageWork:
    """One micro-batch's work on one stage, as TP rank 0 runs it."""

    forward: Work
    backward: Work
    sent_bytes: int
    """Bytes of the activations the stage sends the next one (its output)."""
    param_names: list[str]
    """The FQNs of the stage chunk's parameters (``stage_param_names``' answer for the stage)."""


def stage_work(model: nn.Module, plan: PipelineParallelPlan, example: torch.Tensor,
               sharding: Callable[[nn.Module, dict[str, int]], dict | None], sizes: dict[str, int],
               loss_fn: Callable, device: str) -> list[StageWork]:
    """Each stage's :class:`StageWork`: one micro-batch's forward and backward on meta under a
    ``WorkCounter`` (through ``stage_activations``, which hands each stage what the previous one
    sends), with the TP plan applied over a fake world of the TP size (a fresh mesh dim name per
    trace, as ``estimate.trace`` does), or the experts' EP plan over one of the EP size; its
    collectives' group named as :func:`sharding_groups` names it."""
    counter, sent, names = WorkCounter(), [], []

    def counted(chunk: nn.Module, prepare: Callable[[nn.Module], nn.Module] = lambda chunk: chunk) -> nn.Module:
        names.append([n for n, _ in chunk.named_parameters()])  # before TP replaces them
        counter.region("setup")  # applying TP is no stage's work
        chunk = prepare(chunk)
        index = len(sent)
        counter.region(index)
        sent.append(0)
        chunk.register_forward_hook(lambda module, args, output: sent.__setitem__(index, _bytes(output)))
        return chunk

    with traced_world(sizes) as (mesh, context), fused_attention(device, context):
        # (attention across CP: its exchanges recorded over the CP group, named so)
        names_of = {context.mesh.get_group().group_name: "CP"} if context is not None else {}
        shard = (functools.partial(parallelize_on_meta, mesh=mesh, plan=sharding(model, sizes))
                 if sizes["TP"] * sizes["EP"] > 1 else lambda chunk: chunk)
        with counter:
            stage_activations(model, plan, sizes["PP"], example, loss_fn=loss_fn,
                              prepare=lambda chunk: counted(chunk, shard))
    group = next(iter(sharding_groups(sizes)))
    return [StageWork(named_group(counter.work[s].forward, group, names_of),
                      named_group(counter.work[s].backward, group, names_of), sent[s], names[s])
            for s in range(len(sent))]


def _bytes(output) -> int:
    """Bytes of the floating-point tensors in a stage's output (a DTensor's local shard)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tree_flatten(output)[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def stage_buffers(model: nn.Module, names: list[str], shapes: dict[str, torch.Size], sizes: dict[str, int],
                  bucket_size: int | None) -> tuple[list, int]:
    """DDP's buffers for one stage chunk on the first TP and EP rank (``plan_buffers``, as the memory
    estimate builds them; ``shapes``: that rank's local shape of each FQN, :func:`first_shapes`), and
    the bytes of the chunk's parameters TP replicates (their grads are partial over TP: all-reduced
    once per step). With ``ep > 1`` the experts (divided over EP) are reduced over DP, the rest over DP x EP."""
    dp, ep, tp = sizes["DP"] * sizes["CP"], sizes["EP"], sizes["TP"]  # (CP ranks: other tokens of the same rows)
    params, replicated = [], 0
    for n in names:
        p = parameters(model)[n]
        local = shapes[n]
        group = ("DP", dp) if ep == 1 or local != p.shape else ("DPxEP", dp * ep)
        params.append((n, p.dtype, local.numel(), local.numel(), *group))
        if tp > 1 and local == p.shape:
            replicated += p.numel() * torch.promote_types(p.dtype, torch.float32).itemsize
    buffers = plan_buffers(params, bucket_size=bucket_size,
                           grad_dtype_of=lambda dt: torch.promote_types(dt, torch.float32))
    return buffers, replicated


def first_shapes(model: nn.Module, plan_dict: dict | None, sizes: dict[str, int]) -> dict[str, torch.Size]:
    """The first TP and EP rank's local shape of every parameter, under each of its FQNs."""
    mesh = {"EP": sizes["EP"], "TP": sizes["TP"]} if sizes["EP"] > 1 else {"TP": sizes["TP"]}
    shapes = local_param_shapes(model, plan_dict, mesh, dict.fromkeys(mesh, 0))
    first = {id(p): n for n, p in model.named_parameters()}
    return {n: shapes[first[id(p)]] for n, p in parameters(model).items()}


def optimizer_seconds(machine: Machine, optimizer_kwargs: dict, clip: float) -> Callable[[int, int, torch.dtype], float]:
    """``seconds(runs, elements, param_dtype)``: AdamW and the grad clip over ``runs`` flat masters of
    ``elements`` in all, as ``DistributedOptimizer`` steps its owned runs (one inner step; the clip's
    norm per run), counted on meta once per dtype for three probes and interpolated: the work is affine
    in the runs (ops, per-run scalars) and in the elements (bytes)."""
    probes: dict[torch.dtype, tuple[float, float, float]] = {}
    size = 1 << 16

    def seconds(runs: int, elements: int, param_dtype: torch.dtype) -> float:
        if param_dtype not in probes:
            master = torch.promote_types(param_dtype, torch.float32)
            probes[param_dtype] = tuple(
                machine.compute_seconds(_optimizer_work(pieces, master, optimizer_kwargs, clip), master)
                for pieces in ([size], [size, size], [2 * size]))
        one, two, double = probes[param_dtype]
        return one + (runs - 1) * (two - double) + (elements - size) / size * (double - one)

    return seconds


def _optimizer_work(pieces: list[int], master: torch.dtype, optimizer_kwargs: dict, clip: float) -> Work:
    """AdamW and the grad clip over master runs of these sizes, counted on meta: torch's unfused step
    (its fused kernel, which ``DistributedOptimizer`` uses on CPU and CUDA, refuses meta tensors), so
    an upper bound: the fused kernel makes one pass over the state where this counts one per op."""
    params = [nn.Parameter(torch.zeros(n, dtype=master, device="meta")) for n in pieces]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params, **optimizer_kwargs)
    optimizer.step()  # the state exists from the first step on
    with WorkCounter() as counter:
        if clip:
            # at least fp32, as ndweave.optim.grad_norm computes it (a float64 model's in float64)
            dtype = torch.promote_types(torch.float32, master)
            norms = torch.stack([torch.linalg.vector_norm(p.grad, dtype=dtype) for p in params])
            coefficient = torch.clamp(clip / (norms.square().sum().sqrt() + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(coefficient)
        optimizer.step()
    return counter.work["all"].total


def table(step: StepTime) -> str:
    """The estimate as text: a row per term (ms), the step last."""
    rows = [f"{t.name:<48} {t.seconds * 1e3:>10.2f} ms  {t.owner}{'' if t.in_total else '  (in the above)'}"
            for t in step.terms]
    return "\n".join(rows + [f"{'step':<48} {step.seconds * 1e3:>10.2f} ms"])
