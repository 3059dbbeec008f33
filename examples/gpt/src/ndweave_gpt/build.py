"""What the job trains, built one concern at a time, in this order: the mesh (:func:`build_mesh`), the
whole model (:func:`build_model`), its parallel form (:func:`parallelize`: pipeline stages by FQN, the
TP+SP or EP plan per stage, ``--init-from``, DDP per stage, the engine), then the optimizer and its lr
schedule (:func:`build_optimizer`). Everything is passed in: the mesh, the config.

    mesh = build_mesh(config)
    model = build_model(config)
    job = parallelize(model, mesh, config)           # Parallel(chunks, engine)
    job.optimizer, job.scheduler = build_optimizer(job.chunks, config)
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ndweave.checkpoint import load
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.dmodule.context import ContextParallel
from ndweave.mesh import ParallelMesh, init_mesh_from_spec
from ndweave.mesh.torch_compat import non_persistent_buffer_names
from ndweave.optim import DistributedOptimizer
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage
from ndweave_gpt.config import DIMS, DTYPES, JobConfig, ParallelConfig, num_experts
from ndweave_gpt.data import VOCAB_SIZE, TextData, example_batch
from ndweave_gpt.models import hf
from ndweave_gpt.models.nanogpt import GPT, GPTConfig

__all__ = ["EXPERTS", "MaskedLoss", "Parallel", "adamw_kwargs", "blocks", "build_data", "build_mesh",
           "build_model", "build_optimizer", "check_mesh", "data_mean", "data_rank", "data_sum", "first_step_timeout",
           "global_tokens", "init_weights", "loss_fn", "loss_scale", "lr_factor", "lr_schedule", "materialize",
           "mesh_problem", "parallelize", "plan_name", "sharding_plan", "to_device"]

#: The MoE blocks' stacked experts (``--moe-experts``), what the ``"expert_parallel"`` patch divides over EP.
EXPERTS = r"transformer\.h\.\d+\.mlp\.experts"


def build_mesh(config: JobConfig) -> ParallelMesh:
    """The job's mesh of ``--mesh`` over the default process group (created here if need be)."""
    if config.parallel.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return init_mesh_from_spec(config.parallel.device, config.parallel.mesh, dims=DIMS,
                               timeout=first_step_timeout(config.parallel))


def first_step_timeout(parallel: ParallelConfig) -> float:
    """The groups' timeout when they are made: --timeout, or with --compile the longer --compile-timeout,
    since the first step compiles every block while peers wait (``loop.settle_timeouts`` lowers it)."""
    return max(parallel.timeout, parallel.compile_timeout) if parallel.compile else parallel.timeout


def check_mesh(mesh: ParallelMesh, config: JobConfig) -> None:
    """What the mesh and the flags cannot run together: one error naming both (every rank alike)."""
    problem = mesh_problem(config, {d: mesh[d].size() for d in DIMS})
    if problem:
        raise SystemExit(f"error: {problem}")


def mesh_problem(config: JobConfig, sizes: dict[str, int]) -> str | None:
    """Why the flags cannot run on a mesh of ``sizes`` (None: they can); ``--mesh auto`` skips such layouts."""
    ep, tp, experts = sizes["EP"], sizes["TP"], num_experts(config)
    model, parallel, global_batch = config.model, config.parallel, config.data.global_batch
    slices = sizes["DP"] * ep
    if global_batch % (slices * parallel.micro_batches):
        return (f"--global-batch {global_batch} must split into DP x EP={slices} ranks x --micro-batches "
                f"{parallel.micro_batches}: use a multiple of {slices * parallel.micro_batches}")
    if ep > 1 and not experts:
        return (f"--mesh {parallel.mesh} has ep={ep}, but the model has no experts to divide over it: add "
                "--moe-experts N (MoE blocks), or make those ranks data parallel (dp)")
    what = f"--moe-experts {experts}" if model.hf_config is None else f"{model.name}'s {experts} experts"
    if experts % ep:
        return f"{what} do not divide over ep={ep} ranks: use a multiple of {ep} experts, or an ep that divides {experts}"
    if experts and tp > 1:
        plan = "the nanogpt plan has" if model.hf_config is None else "the job has"
        return (f"{what.split(' ')[0]} with tp={tp}: {plan} no tensor-parallel layout for MoE blocks; use tp=1 (ep and "
                "dp split the batch)")
    cp = sizes["CP"]
    if cp > 1 and model.block_size % (2 * cp):
        return (f"--block-size {model.block_size} must split into 2 x cp={2 * cp} chunks (each CP rank a head and a "
                f"tail chunk of every sequence): use a multiple of {2 * cp}")
    window = getattr(model.hf_config, "sliding_window", None) if model.hf_config is not None else None
    if cp > 1 and window and window < model.block_size:
        return (f"cp={cp} with {model.name}'s sliding window of {window} tokens is not supported yet by the job "
                f"(ndweave.dmodule.context takes window=; the job passes causal masks only): use a --block-size of at "
                f"most {window}, or make those ranks dp")
    if ep > 1 and plan_name(config) == "auto":
        return (f"ep={ep} divides experts with the zoo's MoE plans (hf:mixtral, hf:qwen2_moe, hf:qwen3_moe, "
                f"hf:deepseek_v3, nanogpt); {model.name} with --plan {parallel.tp_plan} has none: make those ranks "
                "data parallel (dp)")
    return None


def data_rank(mesh: ParallelMesh) -> tuple[int, int]:
    """``(this rank's slice, slices)`` of each batch: the DP and EP ranks split it (EP inner)."""
    ep = mesh["EP"].size()
    return mesh["DP"].get_local_rank() * ep + mesh["EP"].get_local_rank(), mesh["DP"].size() * ep


def token_slices(mesh: ParallelMesh) -> int:
    """Ranks that split each global batch's tokens: DP and EP ranks its rows, CP ranks each row's tokens."""
    return data_rank(mesh)[1] * mesh["CP"].size()


def data_sum(value: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """``value`` summed over the ranks that split the batch, in place."""
    for dim in ("DP", "CP", "EP"):
        if mesh[dim].size() > 1:
            dist.all_reduce(value, group=mesh[dim].get_group())
    return value


def data_mean(value: torch.Tensor, mesh: ParallelMesh) -> float:
    """The mean of a value over the ranks that split the batch (equal slices: the global mean)."""
    return data_sum(value, mesh).item() / token_slices(mesh)


def build_data(config: JobConfig, show: bool = False):
    """What each step reads: Shakespeare's bytes (``TextData``), or ``--data`` prepared on rank 0 and
    packed (``TokenData``; collective), its ids checked against the model's vocabulary."""
    if not config.data.data:
        return TextData(config.model.block_size, config.training.seed)
    from ndweave_gpt.data.tokens import TokenData

    hf_config = config.model.hf_config
    vocab_size = hf_config.vocab_size if hf_config is not None else config.model.vocab_size or VOCAB_SIZE
    return TokenData(config, vocab_size, dist.get_rank() if dist.is_initialized() else 0, show)


def to_device(batch: tuple, device: str) -> tuple:
    """A batch's ``(inputs, targets)`` on ``device`` (inputs a tensor or a dict of them)."""
    inputs, targets = batch
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}, targets.to(device)
    return inputs.to(device), targets.to(device)


def global_tokens(targets: torch.Tensor, real: int, mesh: ParallelMesh) -> tuple[float, int]:
    """The global batch's trained tokens (targets not ``-100``) and real ones (not padding; ``real`` this
    rank's), summed over the ranks that split it in one all-reduce."""
    real = real if mesh["CP"].get_local_rank() == 0 else 0  # (CP ranks share rows: count them once)
    counts = torch.stack([(targets != -100).sum().to(torch.float64),
                          torch.tensor(float(real), dtype=torch.float64, device=targets.device)])
    trained, total = data_sum(counts, mesh).tolist()
    return trained, int(total)


def loss_scale(trained: float, mesh: ParallelMesh, config: JobConfig) -> float:
    """``MaskedLoss.scale`` for a global batch of ``trained`` tokens trained on: micro-batches x the slices
    (DP, EP, CP) over them."""
    return config.parallel.micro_batches * token_slices(mesh) / max(trained, 1.0)


def build_model(config: JobConfig, device: str | None = None) -> nn.Module:
    """The whole model, the same on every rank and in the single-device run (seeded, built in fp32 and
    cast, so every --dtype starts from the same weights): models/nanogpt.py's GPT, or the hf: model from
    its config. No biases in the GPT: a key-projection bias has an exactly-zero true gradient, which Adam
    turns into rounding-noise steps. ``device="meta"`` builds it without memory (--init-from: each
    stage chunk is materialized and loaded on its own ranks)."""
    m = config.model
    torch.manual_seed(config.training.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device(device or config.parallel.device):
            if m.hf_config is not None:
                from transformers import AutoModelForCausalLM  # optional: only hf: models need it

                model = AutoModelForCausalLM.from_config(m.hf_config)
            else:
                model = GPT(GPTConfig(vocab_size=m.vocab_size or VOCAB_SIZE, block_size=m.block_size, n_layer=m.n_layer,
                                      n_head=m.n_head, n_embd=m.n_embd, dropout=0.0, bias=False,
                                      moe_experts=m.moe_experts, moe_top_k=m.moe_top_k))
    finally:
        torch.set_default_dtype(previous)
    if config.parallel.activation_checkpointing:  # per layer, inside each layer: a pipeline trace sees it as one call
        model.activation_checkpointing_enable()
    return model.train().to(DTYPES[m.dtype])  # (transformers builds its models in eval mode)


def init_weights(chunks: list[nn.Module], ties: dict[str, str], config: JobConfig) -> None:
    """--init-from: its weights into this rank's chunks (each rank reads only the slices it holds); a
    transformers folder stores a tied LM head once, under the embedding's name (``ties``: the whole
    model's, :func:`~ndweave_gpt.models.hf.tied_aliases`, taken before a pipeline cut)."""
    source = config.model.init_from
    key = None if os.path.isdir(source) else "model"  # a torch file holds the model's state dict
    load(source, {"model": chunks}, key=key, aliases=ties)


def materialize(chunk: nn.Module, device: str) -> None:
    """A chunk of a model built on meta, allocated on ``device`` (its values undefined until loaded);
    its non-persistent buffers (rotary tables: no checkpoint holds them) computed as the model's own
    init computes them."""
    chunk.to_empty(device=device)
    for module in chunk.modules():
        if non_persistent_buffer_names(module) and hasattr(chunk, "_init_weights"):
            chunk._init_weights(module)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens, at least in fp32 (bf16 logits are upcast)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MaskedLoss:
    """``--data``'s loss: the cross-entropy summed over the tokens trained on (targets ``-100`` are not:
    a document's boundary, padding, an SFT prompt) times :attr:`scale`, which the loop sets each step
    to ``micro-batches x DP slices / trained tokens in the global batch``. Averaged over the micro-batches
    and the DP ranks as the engine and DDP do, that is the mean over the global batch's trained tokens,
    whatever the mesh (a mean per micro-batch would weigh tokens by how the mesh groups them)."""

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") * self.scale


def plan_name(config: JobConfig) -> str:
    """The sharding plan's name: ``auto`` (--plan auto), else the zoo's for the model's family
    (``nanogpt``, ``hf_llama``, ``hf_mixtral``, ...), or ``auto`` for a family the zoo lacks."""
    if config.parallel.tp_plan == "auto":
        return "auto"
    hf_config = config.model.hf_config
    return "nanogpt" if hf_config is None else hf.plan_name(hf_config.model_type)


def sharding_plan(model: nn.Module, config: JobConfig, sizes: dict[str, int]) -> dict | None:
    """The TP+SP plan (``tp > 1``), else the experts' EP plan (``ep > 1``), of ``model`` (the whole
    model or a stage chunk) for a mesh of ``sizes``; ``None`` when neither applies."""
    name = plan_name(config)
    if sizes["TP"] > 1:
        return get_plan(name, model, sequence_parallel=not config.parallel.no_sp)
    if sizes["EP"] > 1:
        return get_plan(name, model, expert_parallel=True) if config.model.hf_config is not None \
            else {"patch": {EXPERTS: ["expert_parallel"]}}
    return None


@dataclass
class Parallel:
    """The model as this rank trains it."""

    chunks: list[nn.Module]
    """This rank's stage chunks, each parallelized and wrapped in DDP."""
    engine: PipeEngine
    """Runs a step's micro-batches through the stages (``engine(x, y)``: the mean loss)."""
    optimizer: DistributedOptimizer | None = None
    """:func:`build_optimizer`'s, once built (after the engine, which marks the tied copies)."""
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    """The optimizer's lr schedule."""
    loss: MaskedLoss | None = None
    """``--data``: the engine's loss, its scale set per step; ``None``: :func:`loss_fn`, the mean."""
    cp: ContextParallel | None = None
    """cp > 1: each sequence split over the CP ranks (:func:`context_batch`), attention across them
    (:func:`attending`)."""


def context_batch(cp: ContextParallel | None, inputs: torch.Tensor | dict, targets: torch.Tensor) -> tuple:
    """A batch as this CP rank trains on it: its tokens of each sequence, with their global positions
    (--data's packed documents: their own positions, and this rank's rows of the document mask, which
    covers the whole sequence's keys)."""
    if cp is None:
        return inputs, targets
    if isinstance(inputs, dict):
        return {"input_ids": cp.shard(inputs["input_ids"]), "position_ids": cp.shard(inputs["position_ids"]),
                "attention_mask": cp.shard(inputs["attention_mask"], dim=2)}, cp.shard(targets)
    positions = cp.position_ids(inputs.shape[1], inputs.device).expand(inputs.shape[0], -1).contiguous()
    return {"input_ids": cp.shard(inputs), "position_ids": positions}, cp.shard(targets)


def attending(cp: ContextParallel | None) -> contextlib.AbstractContextManager:
    """Where the engine runs: attention across the CP ranks (cp > 1). A transformers model traced into
    pipeline stages builds its causal mask for the local tokens (tracing keeps it from passing none), which
    CP may replace with the causal one of global positions; --data's document mask, this rank's rows of
    the whole sequence's (:func:`context_batch`), is used as given."""
    return cp.attention(replace_model_mask=True) if cp is not None else contextlib.nullcontext()


def parallelize(model: nn.Module, mesh: ParallelMesh, config: JobConfig) -> Parallel:
    """Cut the pipeline stages (by FQN), parallelize each stage chunk with the TP+SP plan (--plan), load
    --init-from, wrap each chunk in DDP, then build the engine (this order: a plan applies to a chunk,
    the engine reads the wrapped chunks)."""
    parallel = config.parallel
    plan = PipelineParallelPlan(schedule_type=parallel.schedule, virtual_chunks=parallel.virtual_chunks,
                                num_microbatches=parallel.micro_batches)
    on_meta = next(model.parameters()).is_meta
    # one micro-batch's shape: the pipeline traces the model's forward once (on meta tensors) to cut it;
    # its batch size too, since a trace answers shape questions from it (HF's mask building)
    rows = config.data.global_batch // (data_rank(mesh)[1] * parallel.micro_batches)
    device = "meta" if on_meta else parallel.device
    cp = mesh["CP"].size()
    example = example_batch(config, rows, device, cp)  # --data: a dict with the document mask; cp: positions
    tensor_parallel, expert_parallel = mesh["TP"].size() > 1, mesh["EP"].size() > 1
    # "auto" derives the plan from the whole model, before the cut: stage chunks keep its FQNs, and a
    # plan key naming a module another stage holds matches nothing there, as expected
    sizes = {d: mesh[d].size() for d in DIMS}
    auto = sharding_plan(model, config, sizes) if plan_name(config) == "auto" else None
    ties = hf.tied_aliases(model)  # before the cut, which gives the last stage a copy of its own
    context = ContextParallel(mesh) if cp > 1 else None
    with attending(context):  # (the cut traces the layers on meta tensors: a CP rank's, its mask over all keys)
        module = construct_pipeline_stage(model, plan, mesh, example_inputs=example)
    for i in range(len(module)):
        if on_meta:  # this stage only, before TP shards it
            materialize(module[i], parallel.device)
        if tensor_parallel:
            module[i] = parallelize_module(module[i], mesh["TP"], auto or sharding_plan(module[i], config, sizes))
        elif expert_parallel:  # this chunk's experts over EP (the mesh passed whole: the patch finds "EP")
            module[i] = parallelize_module(module[i], mesh, sharding_plan(module[i], config, sizes))
    if config.model.init_from:
        init_weights(list(module.chunks), ties, config)
    if parallel.compile:  # each block in place (FQNs unchanged), its plan applied, before DDP's hooks
        for chunk in module.chunks:
            for block in blocks(chunk):
                block.compile()
    for i in range(len(module)):
        # with EP or CP: the mesh whole, so DDP reduces dense grads over DP x CP x EP and the experts' over DP x
        # CP (CP ranks train on other tokens of the same rows)
        module[i] = DDP(module[i], mesh if expert_parallel or cp > 1 else mesh["DP"], zero_stage=parallel.zero_stage)
    loss = MaskedLoss() if config.data.data else None
    engine = PipeEngine(module, mesh, loss or loss_fn, plan)  # before the optimizer: it marks the tied copy
    return Parallel(list(module.chunks), engine, loss=loss, cp=context)


def blocks(chunk: nn.Module) -> list[nn.Module]:
    """The transformer blocks a stage chunk holds: its first ``ModuleList`` (nanogpt's ``transformer.h``,
    transformers' ``model.layers``), empty for a chunk without one."""
    return list(next((m for m in chunk.modules() if isinstance(m, nn.ModuleList)), []))


def adamw_kwargs(config: JobConfig) -> dict:
    training = config.training
    return {"lr": training.lr, "weight_decay": training.weight_decay, "betas": (0.9, 0.99)}


def lr_schedule(optimizer: torch.optim.Optimizer, config: JobConfig,
                extended_from: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to --lr, then cosine decay to --min-lr at --steps. ``extended_from``: a run of that
    many steps resumed with this longer --steps, its schedule until then and this one's after (what
    the resumed run steps by; the one-process reference of an extended run)."""
    steps = config.training.steps
    before, after = lr_factor(config, extended_from or steps), lr_factor(config, steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: (before if extended_from and step < extended_from else after)(step))


def lr_factor(config: JobConfig, steps: int) -> Callable[[int], float]:
    """The lr schedule of a run of ``steps`` steps: step index -> multiple of --lr."""
    t = config.training

    def factor(step: int) -> float:
        if step < t.warmup:
            return (step + 1) / t.warmup
        progress = min(1.0, (step - t.warmup) / max(1, steps - t.warmup))
        return (t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))) / t.lr
    return factor


def build_optimizer(chunks: list[nn.Module], config: JobConfig):
    """ZeRO's ``DistributedOptimizer`` (AdamW) over the chunks, and its lr schedule."""
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=chunks, clip_grad=config.training.clip,
                                     optimizer_kwargs=adamw_kwargs(config))
    return optimizer, lr_schedule(optimizer, config)
