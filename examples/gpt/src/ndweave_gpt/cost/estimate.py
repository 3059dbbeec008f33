"""What the job will hold on each rank for a layout, before launch: no process started, no parameter
allocated (the model is built on meta).

Each package answers for its own layout and the job only adds the answers up (the packages never
import each other; they meet in ``ndweave.plan.estimate``' ``MemoryTerm``):

* ``ndweave.pipeline.cost``: the parameters each stage holds, one micro-batch's activations per stage
  (its forward and backward run on meta) and the order in which the schedule runs its micro-batches;
* ``ndweave.dmodule.cost``: each parameter's local shape under the TP (or EP) plan, and the model
  itself sharded on meta, whose forward and backward of one micro-batch, run on meta over a fake
  process group, shows what tensor parallelism leaves saved for backward and the step's temporaries
  (with experts over EP, each rank's tokens routed evenly: meta has no routing values to count);
* ``ndweave.ddp.buffer.plan_buffers``: the parameter and grad buffers DDP lays the chunk out in,
  padding included (the function DDP itself calls), and ``ndweave.ddp.cost.grad_sync``: what syncing
  them holds beyond (ZeRO-1's ``.grad`` copies, ZeRO-2's full-size buckets in flight);
* ``ndweave.optim.cost.state_bytes_per_rank``: AdamW's state and master weights for this rank's range
  of each bucket (the arithmetic ``DistributedOptimizer`` does);
* the job: its dataset, held whole by every rank (in host memory: counted on ``--device cpu`` only),
  and what torch's pipeline stage and the wrappers hold around those layouts, each found by
  measuring the job (``--memory-check``): a stage's output, kept until its micro-batch's backward,
  and the buffers it receives into (``receive buffers``,
  ``ndweave.pipeline.cost.receive_buffer_bytes``); with a multi-stage schedule every tensor sent to
  another rank, kept by its pending send until the step ends; a split backward's grads between its
  input and weight steps; a tied weight's grads summed across PP ranks; and at the end of each
  chunk's backward its grad sync (``grad sync``): DDP's ``.grad`` copies in the parameters' dtype,
  and with ZeRO-2 the full-size buckets still reducing (``cost.in_flight`` adds the pipeline's up).

The attention is traced with the kernel the job's device runs (meta alone takes the math path, which
saves the T x T weights); with ``cp > 1`` a CP rank's tokens run through attention across CP
(``ndweave.dmodule.context``) on meta, whose gathered keys and values are allocated and nothing sent. A rank's peak is its model state and receive buffers plus the larger of two
moments of its step: the most micro-batches in flight and pending sends, the temporaries of one
micro-batch of the stage then running on top; or a chunk's grad sync. The terms add up to it
(``grad sync`` is what the sync holds beyond the first).
Against every rank's measured peak of live tensor bytes on 39 layouts over 1 to 8 ranks, MoE over
EP, CP and ZeRO-2 among them (``tests/integration/test_integration_estimate.py``): 0.979 to 1.045 (ZeRO-2
counts all its full-size buckets in flight at the backward's peak: an upper bound); the job's
default model on pp=2, pp=2 x dp=2 (1F1B and interleaved) and pp=2 x dp=2 x tp=2: 0.991 to 1.004.

    python -m ndweave_gpt --mesh pp=2,dp=2,tp=2 --estimate   # the table, nothing launched
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ndweave.ddp.buffer import plan_buffers
from ndweave.ddp.cost import GradSync, grad_dtype, grad_sync
from ndweave.dmodule.context import ContextParallel
from ndweave.dmodule.cost import local_param_shapes, parallelize_on_meta
from ndweave.mesh import init_device_mesh, resolve_spec
from ndweave.plan.estimate import MemoryTerm, RankMemory
from ndweave.mesh import fake_world
from ndweave.mesh.torch_compat import flash_attention_cpu, local_tensor, storage_id, takes_flash_attention, tree_leaves
from ndweave.optim.cost import state_bytes_per_rank
from ndweave.pipeline import PipelineParallelPlan
from ndweave.pipeline.construct import ModelCut
from ndweave.pipeline.cost import StageActivations, stage_activations, stage_param_names
from ndweave.pipeline.plan import ResolvedPlan, resolve_plan
from ndweave_gpt.config import DIMS, JobConfig
from ndweave_gpt.cost.in_flight import activation_terms, rank_actions
from ndweave_gpt.data import TextData, example_batch

__all__ = ["ChunkState", "StageBytes", "activation_terms", "chunk_buffers", "chunk_state", "data_bytes",
           "estimate_memory", "fused_attention", "local_shapes", "parameters", "peer_shapes", "rank_actions",
           "sharding_mesh", "state_terms", "table", "tied_across_ranks", "tp_mesh", "trace", "traced_world",
           "world_meshes"]

_TRACES = itertools.count()  # a fresh mesh dim name per trace (see trace)
_PARAMETERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # see parameters()


def estimate_memory(args: JobConfig, build_model: Callable[..., nn.Module],
                    sharding: Callable[[nn.Module, dict[str, int]], dict | None], loss_fn: Callable, bucket_size: int,
                    optimizer_kwargs: dict) -> list[RankMemory]:
    """Every rank's estimated peak for ``args.parallel.mesh`` (sizes resolved without a world: no ``-1``), one
    :class:`RankMemory` per coordinate, in rank order. ``build_model(args, "meta")`` is the job's
    model on meta, ``sharding(model, sizes)`` its TP (or EP) plan for the mesh's sizes, or ``None``."""
    sizes = resolve_spec(args.parallel.mesh, None, dims=DIMS)
    pp, dp, ep = sizes["PP"], sizes["DP"], sizes["EP"]
    model = build_model(args, "meta")
    plan = PipelineParallelPlan(schedule_type=args.parallel.schedule, virtual_chunks=args.parallel.virtual_chunks,
                                num_microbatches=args.parallel.micro_batches)
    resolved = resolve_plan(plan, pp)
    rows = args.data.global_batch // (dp * ep * args.parallel.micro_batches)
    example = example_batch(args, rows, "meta", sizes["CP"])  # --data: the document mask; cp: a CP rank's tokens
    names = stage_param_names(model, plan, pp, example_inputs=example)
    plan_dict = sharding(model, sizes)
    # the dataset stays in host memory: on a GPU it is no part of the device's peak
    data = data_bytes(args) if torch.device(args.parallel.device).type == "cpu" else 0
    # one micro-batch's activations per stage, traced once: the TP peers' differ only by an uneven
    # vocabulary's last row block
    traced, io = trace(build_model(args, "meta"), plan, example, plan_dict, sizes, loss_fn, args.parallel.device)
    tied = tied_across_ranks(model, names, resolved)
    ranks = []
    for coordinate in _coordinates(sizes):
        shapes = local_shapes(model, plan_dict, sizes, coordinate)
        terms, syncs = [MemoryTerm("data", data, "job")], {}
        stages = resolved.stages_of(coordinate["PP"])
        for stage in stages:
            state, syncs[stage] = model_state_terms(model, names[stage], shapes, sizes, coordinate, bucket_size,
                                                     optimizer_kwargs, args.parallel.zero_stage)
            terms += state
        tied_grads = sum(_local_bytes(model, n, shapes) for s in stages for n in tied[s])
        terms += activation_terms(resolved, traced, io, coordinate, tied_grads, syncs)
        ranks.append(RankMemory(coordinate, tuple(terms)))
    return ranks


def _coordinates(sizes: dict[str, int]) -> list[dict[str, int]]:
    """Every coordinate of the mesh, row-major (rank order)."""
    out = [{}]
    for d in DIMS:
        out = [{**c, d: i} for c in out for i in range(sizes[d])]
    return out


def local_shapes(model: nn.Module, sharding: dict | None, sizes: dict[str, int], coordinate: dict[str, int],
                  peers: dict[int, dict[str, torch.Size]] | None = None) -> dict[str, list[torch.Size]]:
    """``{fqn: [local shape on each TP peer]}`` (a tied parameter under each of its names), this
    rank's first: a buffer slot is as large as the largest peer's shard (``slot_numel``). ``peers``:
    :func:`peer_shapes` for the coordinate, where the caller has them (the ends of the TP dim are
    enough: a dim is chunked as torch chunks it, the largest shards first)."""
    peers = peer_shapes(model, sharding, sizes, coordinate) if peers is None else peers
    order = [coordinate["TP"]] + [t for t in sorted(peers) if t != coordinate["TP"]]
    first = {id(p): n for n, p in model.named_parameters()}
    return {n: [peers[t][first[id(p)]] for t in order] for n, p in parameters(model).items()}


def peer_shapes(model: nn.Module, sharding: dict | None, sizes: dict[str, int], coordinate: dict[str, int],
                 ranks: Iterable[int] | None = None) -> dict[int, dict[str, torch.Size]]:
    """The local shapes (``local_param_shapes``) of TP ranks ``ranks`` (default: all) beside
    ``coordinate`` (its EP rank)."""
    mesh = {"EP": sizes["EP"], "TP": sizes["TP"]} if sizes["EP"] > 1 else {"TP": sizes["TP"]}
    at = {d: coordinate[d] for d in mesh}
    ranks = range(sizes["TP"]) if ranks is None else ranks
    return {t: local_param_shapes(model, sharding, mesh, {**at, "TP": t}) for t in ranks}


def model_state_terms(model: nn.Module, names: list[str], shapes: dict[str, list[torch.Size]], sizes: dict[str, int],
                       coordinate: dict[str, int], bucket_size: int, optimizer_kwargs: dict,
                       zero_stage: int = 1) -> tuple[list[MemoryTerm], GradSync]:
    """One stage chunk's parameters and grads (DDP's buffers: with ``zero_stage=2`` this rank's range of
    each bucket), optimizer state and masters (sharded over the data ranks), and what its grad sync adds."""
    return state_terms(chunk_state(model, names, shapes, sizes, coordinate, bucket_size, optimizer_kwargs),
                        zero_stage)


@dataclass(frozen=True)
class ChunkState:
    """A stage chunk's buffers and optimizer state on one rank, whatever the ZeRO stage."""

    buffers: list
    """DDP's buffers (``plan_buffers``)."""
    state: int
    """The optimizer's state on this rank, in bytes."""
    masters: int
    """Its master weights, in bytes."""
    published: int
    """ZeRO-1's ``.grad`` copies in the parameters' dtype (see :class:`GradSync`)."""


def chunk_state(model: nn.Module, names: list[str], shapes: dict[str, list[torch.Size]], sizes: dict[str, int],
                 coordinate: dict[str, int], bucket_size: int, optimizer_kwargs: dict,
                 buffers: tuple[list, int] | None = None) -> ChunkState:
    """``buffers``: :func:`chunk_buffers` of the same chunk, if at hand (the same on every DP rank)."""
    dp, cp, ep = sizes["DP"], sizes["CP"], sizes["EP"]
    buffers, published = buffers or chunk_buffers(model, names, shapes, sizes, bucket_size)
    state = masters = 0
    for buffer in buffers:
        # the data ranks, row-major: DP x CP, and x EP for a MoE model's dense parameters
        rank_in_group = coordinate["DP"] * cp + coordinate["CP"]
        if buffer.data_parallel_size != dp * cp:
            rank_in_group = rank_in_group * ep + coordinate["EP"]
        layout = [(b.end - b.start, [(offset, n) for _, offset, n in b.entries]) for b in buffer.buckets]
        opt = state_bytes_per_rank(layout, data_parallel_size=buffer.data_parallel_size, dp_rank=rank_in_group,
                                   param_dtype=buffer.param_dtype, optimizer=torch.optim.AdamW,
                                   optimizer_kwargs=optimizer_kwargs)
        state, masters = state + opt.state, masters + opt.masters
    return ChunkState(buffers, state, masters, published)


def chunk_buffers(model: nn.Module, names: list[str], shapes: dict[str, list[torch.Size]], sizes: dict[str, int],
                   bucket_size: int) -> tuple[list, int]:
    """DDP's buffers of one chunk on a rank of ``shapes`` (its TP and EP coordinates), and the bytes of
    ZeRO-1's ``.grad`` copies."""
    data, ep = sizes["DP"] * sizes["CP"], sizes["EP"]  # (CP ranks train on other tokens of the same rows)
    params, published, seen = [], 0, set()
    for n in names:
        p = parameters(model)[n]
        local, *_ = shapes[n]
        expert = ep > 1 and local != p.shape  # sharded over EP: reduced over DP x CP only; dense over EP too
        group, size = ("DP", data) if expert or ep == 1 else ("DPxEP", data * ep)
        params.append((n, p.dtype, local.numel(), max(s.numel() for s in shapes[n]), group, size))
        if grad_dtype(p.dtype) != p.dtype and id(p) not in seen:
            published += local.numel() * p.element_size()
        seen.add(id(p))
    return plan_buffers(params, bucket_size=bucket_size, grad_dtype_of=grad_dtype), published


def state_terms(chunk: ChunkState, zero_stage: int) -> tuple[list[MemoryTerm], GradSync]:
    """:func:`model_state_terms` from the chunk's :class:`ChunkState` (a planner prices a layout at
    ZeRO-1 and ZeRO-2 from one)."""
    buffers = chunk.buffers
    sync = grad_sync(buffers, zero_stage, chunk.published)  # ndweave.ddp.cost: what DDP holds beyond its buffers
    return ([MemoryTerm("parameters", sum(b.param_bytes() for b in buffers), "ddp"),
             MemoryTerm("gradients", sum(b.grad_bytes(zero_stage) for b in buffers), "ddp"),
             MemoryTerm("optimizer state", chunk.state, "optim"),
             MemoryTerm("master weights", chunk.masters, "optim")], sync)


def parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``model``'s parameters by every FQN (a tied one under each), looked up once per model:
    ``get_parameter`` walks the module tree per call, which pricing many layouts of a big model repeats."""
    table = _PARAMETERS.get(model)
    if table is None:
        table = _PARAMETERS[model] = dict(model.named_parameters(remove_duplicate=False))
    return table


def tied_across_ranks(model: nn.Module, names: list[list[str]], resolved: ResolvedPlan) -> list[list[str]]:
    """Per stage, its names of the weights it shares with a stage of another PP rank (a tied embedding
    and LM head): the pipeline sums their grads across those ranks, holding a copy of each over the step."""
    rank_of = {stage: rank for rank in range(resolved.pp_size) for stage in resolved.stages_of(rank)}
    ranks_of: dict[int, set[int]] = {}
    for stage, stage_names in enumerate(names):
        for n in stage_names:
            ranks_of.setdefault(id(parameters(model)[n]), set()).add(rank_of[stage])
    return [[n for n in stage_names if len(ranks_of[id(parameters(model)[n])]) > 1] for stage_names in names]


def _local_bytes(model: nn.Module, name: str, shapes: dict[str, list[torch.Size]]) -> int:
    """This rank's shard of parameter ``name``, in bytes."""
    return shapes[name][0].numel() * parameters(model)[name].element_size()


@dataclass(frozen=True)
class StageBytes:
    """What one micro-batch hands a stage, what the stage keeps of its own output, and what a split
    backward keeps between its two steps, in bytes (local shards, floating-point tensors)."""

    received: int
    """Its inputs from the stage before (0 on the first stage, whose input is the token ids)."""
    output: int
    """Its output, which the engine keeps until the micro-batch's backward: the tensors sent on, or
    the last stage's logits (its first tensor, which the loss takes)."""
    weight_op_outputs: int
    """The outputs of the ops that take a weight (linear, norm, embedding layers): with split
    backward (zero bubble) torch's input-grad step keeps their grads for the weight-grad step (none on
    the first stage, whose whole backward is the weight step)."""
    loss_saved: int
    """What the loss saves for backward (on the last stage)."""


def trace(model: nn.Module, plan: PipelineParallelPlan, example: torch.Tensor, sharding: dict | None,
           sizes: dict[str, int], loss_fn: Callable, device: str, *, mesh=None,
           context: ContextParallel | None = None,
           wrap: Callable[[nn.Module], nn.Module] | None = None, setup: Callable[[], None] | None = None,
           cut: ModelCut | None = None) -> tuple[list[StageActivations], list[StageBytes]]:
    """One micro-batch's activations on every stage as TP rank 0 runs them, and each stage's
    :class:`StageBytes`: forward and backward on meta, the TP plan applied over a fake world of the TP
    size (``mesh``: the TP mesh of a fake world the caller holds open, ``context`` its CP dim's
    :class:`ContextParallel` when ``cp > 1``; by default ones of its own: :func:`world_meshes`).
    Without a ``mesh``, the mesh's dim gets a name of its own per trace: DTensor caches sharding
    decisions by mesh *value*, and an equal mesh of an earlier (destroyed) fake world would bring back
    its process groups. ``wrap(chunk)``: called on each stage's chunk, TP applied, before it runs;
    ``setup()``: before TP is applied to it (a work counter's region for what is not the stage's work);
    ``cut``: where the model is cut, traced before (``stage_activations``' argument)."""
    seen: list[list[int]] = []  # per stage: received, output, its first tensor, weight ops' outputs
    loss_saved = _SavedBytes()

    def counted_loss(output, targets) -> torch.Tensor:
        # the loss's own saved-tensor hooks: they count what it saves, and (innermost hooks win) keep
        # it out of the stage's saved bytes, which are then its forward's alone, as the engine counts them
        with torch.autograd.graph.saved_tensors_hooks(loss_saved.pack, loss_saved.unpack):
            return loss_fn(output, targets)

    def watched(chunk: nn.Module) -> nn.Module:  # called once per stage, in stage order
        chunk = wrap(chunk) if wrap is not None else chunk
        counts = [0, 0, 0, 0]
        seen.append(counts)
        running = [False]  # the chunk's own forward, not a checkpoint's recompute in backward

        def start(_, args) -> None:
            counts[0], running[0] = _bytes(args), True

        def end(_, args, out) -> None:
            counts[1], counts[2], running[0] = _bytes(out), _bytes(_first(out)), False

        def weight_op(_, args, out) -> None:
            counts[3] += _bytes(out) if running[0] else 0

        chunk.register_forward_pre_hook(start)
        chunk.register_forward_hook(end)
        for module in chunk.modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                module.register_forward_hook(weight_op)
        return chunk

    with contextlib.ExitStack() as stack:
        if mesh is None:
            mesh, context = stack.enter_context(traced_world(sizes))
        stack.enter_context(fused_attention(device, context))
        if sizes["TP"] == 1 and sizes["EP"] == 1:
            traced = stage_activations(model, plan, sizes["PP"], example, loss_fn=counted_loss, cut=cut,
                                       prepare=lambda chunk: watched(_set_up(chunk, setup)))
        else:
            traced = stage_activations(model, plan, sizes["PP"], example, loss_fn=counted_loss, cut=cut,
                                       prepare=lambda chunk: watched(parallelize_on_meta(_set_up(chunk, setup), mesh,
                                                                                         sharding)))
    last = len(seen) - 1
    return traced, [StageBytes(received, first if stage == last else output, weight_ops if stage > 0 else 0,
                             loss_saved.bytes if stage == last else 0)
                    for stage, (received, output, first, weight_ops) in enumerate(seen)]


def _set_up(chunk: nn.Module, setup: Callable[[], None] | None) -> nn.Module:
    if setup is not None:
        setup()
    return chunk


def tp_mesh(size: int):
    """A one-dim TP mesh of ``size`` ranks in the open fake world, its dim named afresh (see :func:`trace`)."""
    name = f"TP{next(_TRACES)}"
    return init_device_mesh("cpu", (size,), mesh_dim_names=(name,))[name]


@contextlib.contextmanager
def traced_world(sizes: dict[str, int]) -> Iterator[tuple]:
    """A fake world of the CP x EP x TP ranks a stage is traced over, and in it :func:`world_meshes`;
    ``(None, None)`` and no world where they are all 1."""
    if sizes["CP"] * sizes["EP"] * sizes["TP"] == 1:
        yield None, None
        return
    with fake_world(sizes["CP"] * sizes["EP"] * sizes["TP"], rank=0):
        yield world_meshes(sizes)


def world_meshes(sizes: dict[str, int]) -> tuple:
    """In the open fake world of CP x EP x TP ranks: the mesh a stage chunk is parallelized over
    (:func:`sharding_mesh`'s) and, with ``cp > 1``, the :class:`ContextParallel` over the CP dim beside it."""
    if sizes["CP"] == 1:
        return sharding_mesh(sizes), None
    n = next(_TRACES)
    inner, name = (sizes["EP"], "EP") if sizes["EP"] > 1 else (sizes["TP"], f"TP{n}")
    whole = init_device_mesh("cpu", (sizes["CP"], inner), mesh_dim_names=(f"CP{n}", name))
    return whole[name], ContextParallel(whole[f"CP{n}"])


def sharding_mesh(sizes: dict[str, int]):
    """The mesh a stage chunk is parallelized over in the open fake world: :func:`tp_mesh`, or with
    ``ep > 1`` (the job's MoE layouts have ``tp = 1``) the ``"EP"`` mesh the experts' patch looks for,
    the token dispatch balanced on meta (``ndweave.dmodule.experts.dispatch``)."""
    if sizes["EP"] == 1:
        return tp_mesh(sizes["TP"])
    if sizes["TP"] > 1:
        raise NotImplementedError(f"an estimate of ep={sizes['EP']} with tp={sizes['TP']}: the job has no "
                                  "tensor-parallel layout for MoE blocks")
    return init_device_mesh("cpu", (sizes["EP"],), mesh_dim_names=("EP",))


class _SavedBytes:
    """Counts what autograd saves while it is the innermost saved-tensor hook: each storage once."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = local_tensor(tensor)
        if storage_id(local) not in self._seen:
            self._seen.add(storage_id(local))
            self.bytes += local.untyped_storage().nbytes()
        return tensor.detach()  # as autograd keeps it: the tensor itself could tie a node to itself

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _bytes(values) -> int:
    """The bytes of the floating-point tensors among ``values`` (a DTensor's local shard)."""
    leaves = tree_leaves(values)
    return sum(local_tensor(t).numel() * t.element_size() for t in leaves
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _first(values) -> torch.Tensor | None:
    """The first tensor among ``values`` (a model output's logits)."""
    return next((t for t in tree_leaves(values) if isinstance(t, torch.Tensor)), None)


@contextlib.contextmanager
def fused_attention(device: str, context: ContextParallel | None = None) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` on meta as the job's device runs it, while the trace runs.
    Meta always takes the math path, which saves the T x T attention weights for backward; CPU's flash
    kernel (where torch picks it: asked of stand-ins with the inputs' shapes and dtypes that allocate
    one row) and CUDA's fused kernels save the output and its log-sum-exp instead. The function is
    swapped in ``torch.nn.functional`` (where the GPT's and transformers' attention look it up at each
    call), not by a torch-function mode: a mode is off inside its own handler, so the backward it
    would catch recomputes checkpointed layers without it. With ``context`` (its ``attention()`` entered
    too: attention written by hand, masks kept once) a model's call attends across CP
    (``context.attend``, its exchanges allocating on meta what they would for real), whose own attention
    call comes back here."""
    math = F.scaled_dot_product_attention
    routed = [False]

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if context is not None and not routed[0]:
            routed[0] = True
            try:
                return context.attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                      replace_model_mask=True)
            finally:
                routed[0] = False
        tensors = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
        if all(type(t) is torch.Tensor and t.is_meta for t in tensors) and dropout_p == 0.0:
            row = [torch.empty(t.shape[-1], dtype=t.dtype).expand(t.shape) for t in tensors]
            mask = row[3] if attn_mask is not None else None
            if device != "cpu" or takes_flash_attention(*row[:3], attn_mask=mask, is_causal=is_causal, scale=scale,
                                                        enable_gqa=enable_gqa):
                # CPU's flash kernel has a meta kernel and a backward, and takes grouped keys as they are
                return flash_attention_cpu(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return math(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = attention
    try:
        with context.attention(replace_model_mask=True) if context is not None else contextlib.nullcontext():
            yield
    finally:
        F.scaled_dot_product_attention = math


def data_bytes(args: JobConfig) -> int:
    """The dataset every rank holds (its tensors, once per storage); ``--data``'s token shards are memory-
    mapped files the OS pages in and out, counted as none (its index: 8-24 bytes a document)."""
    if args.data.data:
        return 0
    from ndweave.mesh.testing.memory import TensorMemory  # loaded only to measure (see torch_compat)

    with TensorMemory() as memory:
        data = TextData(args.model.block_size, args.training.seed)
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
