"""ndweave's main job: a GPT trained on Shakespeare (bytes) with pipeline x data x tensor(+sequence)
parallelism and a ZeRO optimizer over one device mesh, checkpointed, resumable on any other mesh.

    hatch run train                                          # 8 CPU ranks: pp=2,dp=2,tp=2
    python examples/gpt/train.py --mesh dp=4 --resume        # continue the same run on 4 ranks
    hatch run train --mesh pp=2,dp=2,ep=2 --moe-experts 4    # MoE blocks, experts over EP (8 ranks)
    hatch run train --model hf:qwen2 --config small          # a transformers model (the zoo's plan, else auto)
    hatch run train --init-from llama-dir --export-hf out    # fine-tune a transformers folder, write it back
    hatch run train --mesh pp=2,dp=4 --estimate              # each rank's peak memory, nothing launched
    torchrun --nproc-per-node 8 examples/gpt/train.py --mesh pp=2,dp=-1,tp=2 --device cuda
    torchrun --nnodes=1:4 --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/gpt/train.py --mesh pp=2,dp=-1,tp=2 --resume   # elastic: restarts resume, any 4k ranks

Run without torchrun, the script starts itself under torchrun (``--standalone``) with as many
processes as ``--mesh`` names. The composition, one function per concern: ``ndweave.mesh`` (the
mesh) -> ``ndweave.dmodule`` (the zoo's TP+SP plan for the model, or auto) -> ``ndweave.pipeline`` (stages by FQN,
``PipeEngine``) -> ``ndweave.ddp`` -> ``ndweave.optim`` (``DistributedOptimizer``) ->
``ndweave.checkpoint`` (``CheckpointManager``, ``DataPosition``); see ``parallelize`` for the order
the model is built in.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import estimate  # noqa: E402
import faults  # noqa: E402
import auto_mesh  # noqa: E402
from export_hf import export_hf  # noqa: E402
import hf_models  # noqa: E402
import proxy  # noqa: E402
import report  # noqa: E402
from data import VALIDATION_WINDOWS, VOCAB_SIZE, TextData  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from ndweave.checkpoint import CheckpointManager, DataPosition, load  # noqa: E402
from ndweave.ddp import DEFAULT_BUCKET_SIZE, DistributedDataParallel as DDP  # noqa: E402
from ndweave.dmodule import get_plan, parallelize_module  # noqa: E402
from ndweave.mesh import ParallelMesh, init_mesh_from_spec, resolve_spec, shutdown  # noqa: E402
from ndweave.mesh.calibrate import calibrate  # noqa: E402
from ndweave.mesh.elastic import lost_ranks, restart_count  # noqa: E402
from ndweave.mesh.testing import train_one_process  # noqa: E402
from ndweave.optim import DistributedOptimizer  # noqa: E402
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage, generate  # noqa: E402

__all__ = ["RunResult", "build_mesh", "build_model", "build_optimizer", "check_args", "check_mesh", "data_mean",
           "data_rank", "gather_params", "init_weights", "loss_fn", "lr_factor", "lr_schedule", "main", "materialize",
           "num_experts", "parallelize", "parse_args", "plan_name", "resume_mode", "sample", "train", "train_single_device",
           "validation_loss"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float64": torch.float64}
DIMS = ("PP", "DP", "EP", "TP")
#: The MoE blocks' stacked experts (``--moe-experts``), what the ``"expert_parallel"`` patch divides over EP.
EXPERTS = r"transformer\.h\.\d+\.mlp\.experts"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="pp=2,dp=2,tp=2",
                   help="sizes of pp, dp, ep, tp (omitted: 1; one of them -1: the rest of the world, e.g. dp=-1); "
                        "ep (expert parallel, with --moe-experts): EP ranks split the batch like DP ranks and "
                        "divide the experts; auto: the fastest layout (mesh, schedule, micro-batches, recompute) "
                        "whose estimated memory fits --memory-per-device on --world-size ranks, printed, then run")
    p.add_argument("--world-size", type=int, default=0,
                   help="--mesh auto: ranks to plan for (default: torchrun's WORLD_SIZE, the visible GPUs, or 8 CPU ranks)")
    p.add_argument("--memory-per-device", type=float, default=0.0, metavar="GiB",
                   help="--mesh auto: memory each rank may hold (default: a GPU's memory, or the host's available "
                        "memory shared by the ranks)")
    p.add_argument("--model", default="nanogpt", metavar="nanogpt|hf:TYPE",
                   help="model.py's GPT, or a transformers causal LM of that model type (hf:llama, hf:qwen2, "
                        "hf:mixtral, ...; needs the transformers package)")
    p.add_argument("--config", default="tiny", metavar="tiny|small|CONFIG.json",
                   help="the hf: model's size: a preset (vocabulary 256, the data's bytes) or a config.json")
    p.add_argument("--init-from", default="", metavar="DIR|FILE.pt",
                   help="start from these weights: a transformers checkpoint folder (config.json + model.safetensors "
                        "or its sharded index; the model and its config come from it), or a torch state dict of "
                        "the model --model/--config build; each rank reads only the slices it holds")
    p.add_argument("--export-hf", default="", metavar="DIR",
                   help="at the end, write the trained hf: model as a transformers checkpoint folder "
                        "(AutoModelForCausalLM.from_pretrained(DIR) loads it)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each layer's activations in backward instead of keeping them")
    p.add_argument("--zero-stage", type=int, default=1, choices=(1, 2),
                   help="what the data ranks split: 1, the optimizer's state and masters (ZeRO-1); 2, the grads too "
                        "(ZeRO-2: each backward reduce-scatters its grads, so a step with m micro-batches makes m)")
    p.add_argument("--n-layer", type=int, default=4, help="nanogpt's layers")
    p.add_argument("--n-embd", type=int, default=128, help="nanogpt's width")
    p.add_argument("--n-head", type=int, default=4, help="nanogpt's heads")
    p.add_argument("--block-size", type=int, default=64, help="tokens (bytes) per sample")
    p.add_argument("--moe-experts", type=int, default=0, help="experts per MoE block in place of each MLP (0: dense)")
    p.add_argument("--moe-top-k", type=int, default=2, help="experts each token is routed to (with --moe-experts)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of the whole run (the lr schedule's length)")
    p.add_argument("--stop-at", type=int, default=None, help="end this run after that step, as if interrupted (--resume goes on)")
    p.add_argument("--global-batch", type=int, default=16, help="samples per step, over all DP ranks")
    p.add_argument("--micro-batches", type=int, default=4, help="pipeline micro-batches per DP rank's batch")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble, ...")
    p.add_argument("--virtual-chunks", type=int, default=1, help="stages per PP rank (interleaved schedules: 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the cosine decay")
    p.add_argument("--warmup", type=int, default=40, help="steps of linear warmup")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0: off)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="bf16: bf16 params, fp32 masters")
    p.add_argument("--no-sp", action="store_true", help="tensor parallel without sequence parallel")
    p.add_argument("--plan", choices=["zoo", "auto"], default="zoo",
                   help="the TP plan: the zoo's hand-written one for the model's family (nanogpt, hf_llama, hf_gpt2, "
                        "the MoE families; others: auto), or derived from the model (get_plan('auto'))")
    p.add_argument("--checkpoint-dir", default="checkpoints/gpt")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--resume", nargs="?", const="always", default="auto", choices=["auto", "always", "never"],
                   help="continue from the newest complete checkpoint in --checkpoint-dir: always (bare --resume), "
                        "never, or auto (default): when torchrun has restarted the job")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a collective waits for a peer: a dead rank surfaces as an error within it")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--seed", type=int, default=1234, help="model init and data order")
    p.add_argument("--sample", type=int, nargs="?", const=300, default=0,
                   help="print this many bytes the pipelined model generates at the end")
    p.add_argument("--eval-every", type=int, default=0,
                   help="steps between validation losses on held-out text, through the pipeline (0: none)")
    p.add_argument("--compare-single-device", action="store_true", help="also train on one process and compare")
    p.add_argument("--plot", default="gpt_loss.png", help="loss-curve PNG ('' for none)")
    p.add_argument("--metrics", default="gpt_metrics.jsonl",
                   help="JSON line per step, appended by rank 0: loss, val_loss, lr, grad_norm, tokens_s, step_s, "
                        "peak_bytes ('' for none)")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="also write the metrics as TensorBoard event files in DIR (needs the tensorboard package)")
    p.add_argument("--estimate", action="store_true",
                   help="print each rank's estimated peak memory for --mesh (parameters, grads, optimizer state, "
                        "activations in flight, ...) and exit: nothing launched, nothing allocated")
    p.add_argument("--memory-check", action="store_true",
                   help="also measure each rank's peak of live tensor bytes over the training steps (torch's tracker: "
                        "slow) and print it beside the estimate")
    p.add_argument("--quiet", action="store_true", help="no progress bar or report (tests)")
    faults.add_args(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values argparse's types let through that the job cannot run: one error naming the flag (on
    every rank alike, before any process group exists)."""
    at_least = {"n_layer": 1, "n_embd": 1, "n_head": 1, "block_size": 1, "steps": 1, "global_batch": 1,
                "micro_batches": 1, "virtual_chunks": 1, "warmup": 0, "checkpoint_every": 0, "sample": 0, "eval_every": 0,
                "moe_experts": 0, "moe_top_k": 1, "lr": 0, "min_lr": 0, "weight_decay": 0, "clip": 0}
    for name, low in at_least.items():
        if getattr(args, name) < low or (name == "lr" and args.lr == 0):
            bound = "positive" if name == "lr" else f"at least {low}"
            parser.error(f"--{name.replace('_', '-')} must be {bound}, got {getattr(args, name)}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head} (the head size)")
    if args.moe_experts and args.moe_top_k > args.moe_experts:
        parser.error(f"--moe-top-k {args.moe_top_k} is more than --moe-experts {args.moe_experts}: each token needs "
                     "top-k distinct experts")
    if args.eval_every and args.global_batch > VALIDATION_WINDOWS:
        parser.error(f"--eval-every evaluates a --global-batch of held-out samples: at most {VALIDATION_WINDOWS}, "
                     f"got {args.global_batch}")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        parser.error(f"--stop-at must be between 1 and --steps {args.steps}, got {args.stop_at}")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        parser.error(f"--tensorboard {args.tensorboard}: the tensorboard package is not installed; "
                     "`pip install tensorboard`, or leave the flag out (--metrics writes every step as JSON lines)")
    check_model_args(parser, args)
    if args.device != "cpu":
        module = getattr(torch, args.device.split(":")[0], None)
        if module is None or not hasattr(module, "is_available") or not module.is_available():
            parser.error(f"--device {args.device}: no such device is available here; use --device cpu")


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--model``, ``--config``, ``--init-from`` and ``--export-hf`` together; an hf: model's config
    is read here (``args.hf_config``: None for nanogpt), so a bad one fails before any process group."""
    folder = bool(args.init_from) and os.path.isdir(args.init_from)
    if args.init_from and not folder and not os.path.isfile(args.init_from):
        parser.error(f"--init-from {args.init_from}: no such folder or file")
    if folder and args.model == "nanogpt":
        args.model = "hf:"  # a transformers folder: its config.json names the model type
    if args.model != "nanogpt" and not args.model.startswith("hf:") or args.model == "hf:" and not folder:
        parser.error(f"--model {args.model}: use nanogpt or hf:<model_type> (hf:llama, hf:qwen2, hf:mixtral, ...)")
    args.hf_config = None
    if args.model == "nanogpt":
        if args.export_hf:
            parser.error("--export-hf writes a transformers model: train one with --model hf:<model_type> "
                         "(nanogpt's checkpoints export as torch files: ndweave.checkpoint.export)")
        return
    if args.moe_experts and (folder or args.config not in hf_models.PRESETS):
        parser.error("--moe-experts sizes a preset (--config tiny|small); a config.json says its own experts")
    args.hf_config = hf_models.hf_config(args.model[3:] or None, args.config, block_size=args.block_size,
                                         moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                                         init_from=args.init_from if folder else None)
    args.model = "hf:" + args.hf_config.model_type


def num_experts(args: argparse.Namespace) -> int:
    """Experts per MoE layer of the job's model (0: dense)."""
    return hf_models.experts_of(args.hf_config) if args.hf_config is not None else args.moe_experts


def relaunch_under_torchrun(args: argparse.Namespace, argv: list[str]) -> None:
    """Not started by torchrun: start this script again under it, one process per mesh rank."""
    try:
        world = math.prod(resolve_spec(args.mesh, None, dims=DIMS).values())
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    if args.device == "cuda" and world > torch.cuda.device_count():
        raise SystemExit(f"--mesh {args.mesh} needs {world} GPUs, {torch.cuda.device_count()} are visible")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), *argv]
    os.execv(sys.executable, command)


def build_mesh(args: argparse.Namespace) -> ParallelMesh:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return init_mesh_from_spec(args.device, args.mesh, dims=DIMS, timeout=args.timeout)


def resume_mode(args: argparse.Namespace) -> bool:
    """Whether to load the newest checkpoint: ``--resume always``/``never``, or under ``auto`` when
    torchrun restarted the job on any rank (a node restarted for another's failure counts none)."""
    if args.resume != "auto":
        return args.resume == "always"
    restarted = torch.tensor([restart_count()])
    dist.all_reduce(restarted, op=dist.ReduceOp.MAX)
    return restarted.item() > 0


def build_model(args: argparse.Namespace, device: str | None = None) -> nn.Module:
    """The whole model, the same on every rank and in the single-device run (seeded, built in fp32 and
    cast, so every --dtype starts from the same weights): model.py's GPT, or the hf: model from its
    config. No biases in the GPT: a key-projection bias has an exactly-zero true gradient, which Adam
    turns into rounding-noise steps. ``device="meta"`` builds it without memory (--init-from: each
    stage chunk is materialized and loaded on its own ranks)."""
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device(device or args.device):
            if args.hf_config is not None:
                from transformers import AutoModelForCausalLM  # optional: only hf: models need it

                model = AutoModelForCausalLM.from_config(args.hf_config)
            else:
                model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.block_size, n_layer=args.n_layer,
                                      n_head=args.n_head, n_embd=args.n_embd, dropout=0.0, bias=False,
                                      moe_experts=args.moe_experts, moe_top_k=args.moe_top_k))
    finally:
        torch.set_default_dtype(previous)
    if args.activation_checkpointing:  # per layer, inside each layer: a pipeline trace sees it as one call
        model.activation_checkpointing_enable()
    return model.train().to(DTYPES[args.dtype])  # (transformers builds its models in eval mode)


def init_weights(chunks: list[nn.Module], ties: dict[str, str], args: argparse.Namespace) -> None:
    """--init-from: the weights of ``args.init_from`` into this rank's chunks (each rank reads only the
    slices it holds); a transformers folder stores a tied LM head once, under the embedding's name
    (``ties``: the whole model's, :func:`hf_models.tied_aliases`, taken before a pipeline cut)."""
    source = args.init_from
    key = None if os.path.isdir(source) else "model"  # a torch file holds the model's state dict
    load(source, {"model": chunks}, key=key, aliases=ties)


def materialize(chunk: nn.Module, device: str) -> None:
    """A chunk of a model built on meta, allocated on ``device`` (its values undefined until loaded);
    its non-persistent buffers (rotary tables: no checkpoint holds them) computed as the model's own
    init computes them."""
    chunk.to_empty(device=device)
    for module in chunk.modules():
        if module._non_persistent_buffers_set and hasattr(chunk, "_init_weights"):
            chunk._init_weights(module)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens, at least in fp32 (bf16 logits are upcast)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def plan_name(args: argparse.Namespace) -> str:
    """The sharding plan's name: ``auto`` (--plan auto), else the zoo's for the model's family
    (``nanogpt``, ``hf_llama``, ``hf_mixtral``, ...), or ``auto`` for a family the zoo lacks."""
    if args.plan == "auto":
        return "auto"
    return "nanogpt" if args.hf_config is None else hf_models.plan_name(args.hf_config.model_type)


def parallelize(model: nn.Module, mesh: ParallelMesh, args: argparse.Namespace) -> tuple[list[nn.Module], PipeEngine]:
    """Cut the pipeline stages (by FQN), parallelize each stage chunk with the TP+SP plan (--plan), load
    --init-from, wrap each chunk in DDP, then build the engine (this order: a plan applies to a chunk,
    the engine reads the wrapped chunks)."""
    plan = PipelineParallelPlan(schedule_type=args.schedule, virtual_chunks=args.virtual_chunks,
                                num_microbatches=args.micro_batches)
    on_meta = next(model.parameters()).is_meta
    # one micro-batch's shape: the pipeline traces the model's forward once (on meta tensors) to cut it;
    # its batch size too, since a trace answers shape questions from it (HF's mask building)
    rows = args.global_batch // (data_rank(mesh)[1] * args.micro_batches)
    example = torch.zeros((rows, args.block_size), dtype=torch.long, device="meta" if on_meta else args.device)
    tensor_parallel, expert_parallel = mesh["TP"].size() > 1, mesh["EP"].size() > 1
    # "auto" derives the plan from the whole model, before the cut: stage chunks keep its FQNs, and a
    # plan key naming a module another stage holds matches nothing there, as expected
    sizes = {d: mesh[d].size() for d in DIMS}
    auto = sharding_plan(model, args, sizes) if plan_name(args) == "auto" else None
    ties = hf_models.tied_aliases(model)  # before the cut, which gives the last stage a copy of its own
    module = construct_pipeline_stage(model, plan, mesh, example_inputs=example)
    for i in range(len(module)):
        if on_meta:  # this stage only, before TP shards it
            materialize(module[i], args.device)
        if tensor_parallel:
            module[i] = parallelize_module(module[i], mesh["TP"], auto or sharding_plan(module[i], args, sizes))
        elif expert_parallel:  # this chunk's experts over EP (the mesh passed whole: the patch finds "EP")
            module[i] = parallelize_module(module[i], mesh, sharding_plan(module[i], args, sizes))
    if args.init_from:
        init_weights(list(module.chunks), ties, args)
    for i in range(len(module)):
        # with EP: the mesh whole, so DDP reduces dense grads over DP x EP and the experts' over DP
        module[i] = DDP(module[i], mesh if expert_parallel else mesh["DP"], zero_stage=args.zero_stage)
    engine = PipeEngine(module, mesh, loss_fn, plan)  # before the optimizer: it marks the tied copy
    return list(module.chunks), engine


def sharding_plan(model: nn.Module, args: argparse.Namespace, sizes: dict[str, int]) -> dict | None:
    """The TP+SP plan (``tp > 1``), else the experts' EP plan (``ep > 1``), of ``model`` (the whole
    model or a stage chunk) for a mesh of ``sizes``; ``None`` when neither applies."""
    name = plan_name(args)
    if sizes["TP"] > 1:
        return get_plan(name, model, sequence_parallel=not args.no_sp)
    if sizes["EP"] > 1:
        return get_plan(name, model, expert_parallel=True) if args.hf_config is not None \
            else {"patch": {EXPERTS: ["expert_parallel"]}}
    return None


def memory_estimate(args: argparse.Namespace) -> list:
    """Each rank's estimated peak memory for ``args.mesh`` (:mod:`estimate`), in rank order."""
    return estimate.estimate_memory(args, build_model, lambda model, sizes: sharding_plan(model, args, sizes), loss_fn,
                                    DEFAULT_BUCKET_SIZE, adamw_kwargs(args))


def plan_mesh(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """``--mesh auto``: the fastest layout that fits (:mod:`auto_mesh`), its table printed; ``argv`` with the
    chosen layout's flags in place of the mesh and schedule flags."""
    world = auto_mesh.world_size(args)
    budget = auto_mesh.memory_per_device(args, world)
    # every layout priced from three traced parts of the model (proxy.py), not a trace of it each
    pricer = proxy.Pricer(args, calibrate(args.device, dtypes=[DTYPES[args.dtype]]), build_model,
                          lambda model, sizes: sharding_plan(model, args, sizes), loss_fn, DEFAULT_BUCKET_SIZE,
                          adamw_kwargs(args))
    planned = auto_mesh.choose_layout(
        args, auto_mesh.model_shape(pricer.model, args, num_experts(args)), world, budget,
        peak_bytes=pricer.peak_bytes, step_seconds=pricer.step_seconds, price_ahead=pricer.price_ahead,
        job_rule=lambda a: mesh_problem(a, resolve_spec(a.mesh, None, dims=DIMS)))
    print(f"--mesh auto: {world} ranks, {budget / 2**30:.2f} GiB each\n{planned.table()}")
    if planned.best is None:
        raise SystemExit(f"error: --mesh auto: no layout of {world} ranks fits {budget / 2**30:.2f} GiB per rank "
                         "(see the table): use more ranks, a smaller --global-batch or model, or --memory-per-device")
    keep, skip = [], {"--mesh": 1, "--schedule": 1, "--virtual-chunks": 1, "--micro-batches": 1,
                      "--activation-checkpointing": 0}
    items = iter(argv)
    for item in items:
        name = item.split("=")[0]
        if name in skip:
            if "=" not in item:
                for _ in range(skip[name]):
                    next(items, None)
            continue
        keep.append(item)
    return keep + auto_mesh.layout_flags(planned.best)


def lr_schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace,
                extended_from: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to --lr, then cosine decay to --min-lr at --steps. ``extended_from``: a run of that
    many steps resumed with this longer --steps, its schedule until then and this one's after (what
    the resumed run steps by; the one-process reference of an extended run)."""
    before, after = lr_factor(args, extended_from or args.steps), lr_factor(args, args.steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: (before if extended_from and step < extended_from else after)(step))


def lr_factor(args: argparse.Namespace, steps: int) -> Callable[[int], float]:
    """The lr schedule of a run of ``steps`` steps: step index -> multiple of --lr."""
    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, steps - args.warmup))
        return (args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))) / args.lr
    return factor


def adamw_kwargs(args: argparse.Namespace) -> dict:
    return {"lr": args.lr, "weight_decay": args.weight_decay, "betas": (0.9, 0.99)}


def build_optimizer(chunks: list[nn.Module], args: argparse.Namespace):
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=chunks, clip_grad=args.clip,
                                     optimizer_kwargs=adamw_kwargs(args))
    return optimizer, lr_schedule(optimizer, args)


@dataclass
class RunResult:
    """What a run did, the same on every rank."""

    losses: dict[int, float]
    """Global mean loss of each step this run trained (steps count from 1)."""
    params: dict[str, torch.Tensor]
    """The final whole-model parameters (CPU), by FQN, tied weights under both names."""
    seconds: float = 0.0
    """Wall time of the training steps."""
    tokens_per_s: float = 0.0
    """Tokens trained on per second of ``seconds``, over all ranks."""
    peak_memory: list[int] = field(default_factory=list)
    """Each rank's peak memory in bytes (host RSS on CPU, allocated device memory on CUDA)."""
    mesh: str = ""
    """The mesh it ran on, e.g. ``"PP=2 x DP=2 x TP=2"``."""
    history: dict[int, float] = field(default_factory=dict)
    """Every step's loss since the run began, earlier runs it resumed from included (from the checkpoint)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """The validation loss at every ``--eval-every``-th step since the run began (and the last step)."""
    sample: str = ""
    """The text the trained model wrote (``--sample``)."""
    mfu: float | None = None
    """Estimated model FLOPs utilization over ``seconds`` (None: not on a GPU whose peak is known)."""
    tensor_peak: list[int] = field(default_factory=list)
    """``--memory-check``: each rank's peak of live tensor bytes over the training steps (checkpoint
    saves left out), by torch's tracker; empty otherwise."""


def gather_params(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's parameters, unsharded, on every rank (small models: simplest correct way)."""
    local = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters(remove_duplicate=False):
            # full_tensor is a collective over TP: every TP rank holds the same chunk, same order;
            # cloned: a parameter is a view of DDP's flat buffer, which pickling would send whole
            local[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
    everyone: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, local)
    return {k: v for part in everyone for k, v in part.items()}


def data_rank(mesh: ParallelMesh) -> tuple[int, int]:
    """``(this rank's slice, slices)`` of each batch: the DP and EP ranks split it (EP inner)."""
    ep = mesh["EP"].size()
    return mesh["DP"].get_local_rank() * ep + mesh["EP"].get_local_rank(), mesh["DP"].size() * ep


def data_mean(value: torch.Tensor, mesh: ParallelMesh) -> float:
    """The mean of a value over the ranks that split the batch (equal slices: the global mean)."""
    for dim in ("DP", "EP"):
        dist.all_reduce(value, group=mesh[dim].get_group())
    return value.item() / data_rank(mesh)[1]


def check_mesh(mesh: ParallelMesh, args: argparse.Namespace) -> None:
    """What the mesh and the flags cannot run together: one error naming both (every rank alike)."""
    problem = mesh_problem(args, {d: mesh[d].size() for d in DIMS})
    if problem:
        raise SystemExit(f"error: {problem}")


def mesh_problem(args: argparse.Namespace, sizes: dict[str, int]) -> str | None:
    """Why the flags cannot run on a mesh of ``sizes`` (None: they can); ``--mesh auto`` skips such layouts."""
    ep, tp, experts = sizes["EP"], sizes["TP"], num_experts(args)
    slices = sizes["DP"] * ep
    if args.global_batch % (slices * args.micro_batches):
        return (f"--global-batch {args.global_batch} must split into DP x EP={slices} ranks x --micro-batches "
                f"{args.micro_batches}: use a multiple of {slices * args.micro_batches}")
    if ep > 1 and not experts:
        return (f"--mesh {args.mesh} has ep={ep}, but the model has no experts to divide over it: add --moe-experts N "
                "(MoE blocks), or make those ranks data parallel (dp)")
    what = f"--moe-experts {experts}" if args.hf_config is None else f"{args.model}'s {experts} experts"
    if experts % ep:
        return f"{what} do not divide over ep={ep} ranks: use a multiple of {ep} experts, or an ep that divides {experts}"
    if experts and tp > 1:
        plan = "the nanogpt plan has" if args.hf_config is None else "the job has"
        return (f"{what.split(' ')[0]} with tp={tp}: {plan} no tensor-parallel layout for MoE blocks; use tp=1 (ep and "
                "dp split the batch)")
    if ep > 1 and plan_name(args) == "auto":
        return (f"ep={ep} divides experts with the zoo's MoE plans (hf:mixtral, hf:qwen2_moe, hf:qwen3_moe, "
                f"hf:deepseek_v3, nanogpt); {args.model} with --plan {args.plan} has none: make those ranks data "
                "parallel (dp)")
    return None


def validation_loss(engine: PipeEngine, chunks: list[nn.Module], data: TextData, mesh: ParallelMesh,
                    args: argparse.Namespace) -> float:
    """The mean loss on the held-out batch, forward only through the pipeline (every rank)."""
    x, y = (t.to(args.device) for t in data.validation(args.global_batch, *data_rank(mesh)))
    for chunk in chunks:
        chunk.eval()
    loss = engine.evaluate(x, y).detach().to(torch.float64)
    for chunk in chunks:
        chunk.train()
    return data_mean(loss, mesh)


def sample(engine: PipeEngine, chunks: list[nn.Module], args: argparse.Namespace, prompt: bytes = b"ROMEO:\n") -> str:
    """``args.sample`` bytes the pipelined model writes after ``prompt`` (temperature 0.8, seeded)."""
    for chunk in chunks:
        chunk.eval()
    idx = torch.tensor([list(prompt)], device=args.device)
    tokens = generate(engine, idx, args.sample, max_seq_len=args.block_size, temperature=0.8,
                      generator=torch.Generator().manual_seed(args.seed))
    return _text(tokens[0].tolist())


def _text(tokens: list[int]) -> str:
    """The bytes among ``tokens`` as text (a pretrained model's vocabulary may hold more ids)."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def model_flops(model: nn.Module, args: argparse.Namespace) -> float:
    """Model FLOPs per trained token (:func:`report.flops_per_token`; a MoE counts every expert)."""
    c = args.hf_config
    layers, width = (args.n_layer, args.n_embd) if c is None else (c.num_hidden_layers, c.hidden_size)
    return report.flops_per_token(sum(p.numel() for p in model.parameters()), layers, width, args.block_size)


def device_peak_flops(args: argparse.Namespace) -> float | None:
    """This rank's device's peak FLOP/s at --dtype, where known (CUDA GPUs in report.PEAK_FLOPS)."""
    if not args.device.startswith("cuda"):
        return None
    return report.peak_flops(torch.cuda.get_device_name(), DTYPES[args.dtype])


def peak_memory(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train(args: argparse.Namespace) -> RunResult:
    """The job on this rank (the default process group may exist already, as in the test harness);
    ``--memory-check``: every tensor tracked from before the model is built."""
    if not args.memory_check:
        return _train(args, None)
    from ndweave.mesh.testing.memory import TensorMemory  # loaded only to measure (see torch_compat)

    with TensorMemory() as memory:
        return _train(args, memory)


def _train(args: argparse.Namespace, memory: Any | None) -> RunResult:
    mesh = build_mesh(args)
    rank, (dp_rank, dp_size) = dist.get_rank(), data_rank(mesh)
    check_mesh(mesh, args)
    model = build_model(args, "meta" if args.init_from else None)  # --init-from: each rank allocates its stage
    show = rank == 0 and not args.quiet
    if show:
        report.start(mesh, model, args)
    flops, peak = model_flops(model, args), device_peak_flops(args)  # MFU: on CUDA (a known GPU) only
    chunks, engine = parallelize(model, mesh, args)
    # the stage chunks hold what this rank trains; the rest of the model goes, at once: the pipeline's
    # trace (torch.fx's tracer) leaves it in reference cycles, which only the cyclic collector frees
    del model
    gc.collect()
    optimizer, scheduler = build_optimizer(chunks, args)
    data, position = TextData(args.block_size, args.seed), DataPosition()
    # every step's loss so far (NaN: not trained yet), so a resumed run's plot shows the whole curve
    # lists, not tensors: a checkpoint's history replaces them whole, so a resumed run may go on
    # longer (or shorter) than the run that wrote it
    history, val_history = [math.nan] * args.steps, [math.nan] * args.steps
    fault = faults.FaultInjection(args, rank)
    state = {"model": chunks, "optimizer": optimizer, "scheduler": scheduler, "data": position, "step": 0,
             "rng": torch.get_rng_state(), "loss_history": history, "val_history": val_history,
             "settings": {"global_batch": args.global_batch, "lr": args.lr, "steps": args.steps}}
    if args.hf_config is not None:  # what export_hf.py needs to write a transformers folder from any step
        state["hf_config"] = hf_models.config_json(args.hf_config, DTYPES[args.dtype])
    if args.kill_rank is not None:  # its state_dict() runs inside every save: where --kill-in-save strikes
        state["fault_injection"] = fault
    manager = CheckpointManager(args.checkpoint_dir, keep_last=2)
    start = 0
    if resume_mode(args):
        start = manager.load_latest(state) or 0
        if start > args.steps:  # the same checkpoint on every rank: the same verdict
            raise SystemExit(f"error: the checkpoint in {args.checkpoint_dir} is at step {start}, past --steps "
                             f"{args.steps}: pass --steps {start} or more to continue it, or another --checkpoint-dir")
        torch.set_rng_state(state["rng"])
        # a longer --steps extends the run: the history grows, the lr schedule stretches to the new end
        history, val_history = (_resized(state[key], args.steps) for key in ("loss_history", "val_history"))
        state["loss_history"], state["val_history"] = history, val_history
        changes = _resume_changes(state, scheduler, args)
        if show:
            for change in changes:
                report.say(f"resumed with {change}")
            restarted = f" (torchrun restart {restart_count()}, {mesh.size()} ranks)" if restart_count() else ""
            report.say(f"resumed from step {start} of {manager.path(start)}{restarted}" if start
                       else "no checkpoint: fresh start")
    last = min(args.steps, args.stop_at or args.steps)
    losses, bar, begin = {}, report.progress(start, last, show), time.perf_counter()
    metrics = report.Metrics(args.metrics, args.tensorboard) if rank == 0 and (args.metrics or args.tensorboard) else None
    steps_peak = 0
    if memory is not None:
        memory.reset_peak()  # the steps' peak: what is live now (model state, data) and what they add
    for step in range(start + 1, last + 1):
        fault.before_step(step)
        tick = time.perf_counter()
        x, y = (t.to(args.device) for t in data.batch(position, args.global_batch, dp_rank, dp_size))
        optimizer.zero_grad()
        loss = engine(x, y).detach().to(torch.float64)  # the mean over this DP rank's micro-batches
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]  # the one this step used
        scheduler.step()
        position.advance(args.global_batch)
        losses[step] = history[step - 1] = data_mean(loss, mesh)
        if args.eval_every and (step % args.eval_every == 0 or step == last):
            val_history[step - 1] = validation_loss(engine, chunks, data, mesh, args)
        seconds = time.perf_counter() - tick
        tokens = args.global_batch * args.block_size
        utilization = report.mfu(flops, tokens / seconds, peak, dist.get_world_size())
        report.step(bar, losses[step], tokens, seconds, val_history[step - 1], utilization)
        if rank == 0 and metrics is not None:
            metrics.write(step=step, loss=losses[step], val_loss=val_history[step - 1], lr=lr,
                          grad_norm=optimizer.last_grad_norm, seconds=seconds, tokens=tokens,
                          peak_bytes=peak_memory(args.device), mfu=utilization)
        if memory is not None:
            steps_peak = max(steps_peak, memory.peak_bytes(args.device))
        if step == last or (args.checkpoint_every and step % args.checkpoint_every == 0):
            state["step"], state["rng"] = step, torch.get_rng_state()
            manager.save(step, state)
            if memory is not None:  # a save's staging is the checkpoint's, not the step's
                memory.reset_peak()
            if show:
                report.say(f"checkpoint: step {step} -> {manager.path(step)}")
    seconds = time.perf_counter() - begin
    bar.close()
    if metrics is not None:
        metrics.close()
    text = sample(engine, chunks, args) if args.sample else ""
    peaks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory(args.device))
    tensor_peaks: list[int] = [0] * dist.get_world_size() if memory is not None else []
    if memory is not None:
        dist.all_gather_object(tensor_peaks, steps_peak)
    tokens = (last - start) * args.global_batch * args.block_size
    shown = [d for d in DIMS if d != "EP" or mesh["EP"].size() > 1]  # EP where the run has it
    return RunResult(losses, gather_params(chunks), seconds, tokens / max(seconds, 1e-9), peaks,
                     " x ".join(f"{d}={mesh[d].size()}" for d in shown), _steps(history), _steps(val_history), text,
                     report.mfu(flops, tokens / max(seconds, 1e-9), peak, dist.get_world_size()), tensor_peaks)


def _steps(history: list[float]) -> dict[int, float]:
    """A per-step history (NaN: not there) by step number."""
    return {i + 1: v for i, v in enumerate(history) if not math.isnan(v)}


def _resume_changes(state: dict, scheduler: torch.optim.lr_scheduler.LambdaLR, args: argparse.Namespace) -> list[str]:
    """Settings this run changes from the checkpoint's (allowed: the data position counts samples, the
    schedule is recomputed): the new ones take effect from the next step; what changed, in words."""
    saved = state["settings"]
    changes = [f"--{key.replace('_', '-')} {value} (the checkpoint's run had {saved[key]})"
               for key, value in (("global_batch", args.global_batch), ("lr", args.lr), ("steps", args.steps))
               if saved.get(key, value) != value]
    scheduler.base_lrs = [args.lr] * len(scheduler.base_lrs)  # the schedule's peak is this run's --lr
    # the next step's lr from this run's schedule: the optimizer's checkpoint holds the lr the old
    # schedule (another --steps or --lr) set for it
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    state["settings"] = {"global_batch": args.global_batch, "lr": args.lr, "steps": args.steps}
    return changes


def _resized(history: list[float], steps: int) -> list[float]:
    """A checkpoint's per-step history for a run of ``steps`` (NaN: not trained yet)."""
    return list(history[:steps]) + [math.nan] * (steps - len(history))


def train_single_device(args: argparse.Namespace, micro_batches: int = 1, last: int | None = None,
                        model: nn.Module | None = None, extended_from: int | None = None) -> RunResult:
    """The same run on this one process with plain torch (AdamW, clip_grad_norm_, the same lr
    schedule and data), through the reference loop every parity test uses; ``micro_batches > 1``
    accumulates each batch's gradient in that many parts: the same math, summed in another order.
    bf16 parameters get fp32 masters, as in the parallel run. ``model``: start from it (e.g. what
    transformers' ``from_pretrained`` loads), else from the job's model and --init-from.
    ``extended_from``: the run was written with that --steps and resumed with this longer one there
    (``--resume --steps N``): the shorter lr schedule until then (:func:`lr_schedule`)."""
    if model is None:
        model = build_model(args)
        if args.init_from:
            init_weights([model], hf_models.tied_aliases(model), args)
    data, position, end = TextData(args.block_size, args.seed), DataPosition(), last or args.steps
    val_losses: dict[int, float] = {}

    def batches():
        for _ in range(end):
            yield tuple(t.to(args.device) for t in data.batch(position, args.global_batch))
            position.advance(args.global_batch)

    def validate(index: int, model: nn.Module) -> None:
        step = index + 1
        if args.eval_every and (step % args.eval_every == 0 or step == end):
            with torch.no_grad():
                vx, vy = (t.to(args.device) for t in data.validation(args.global_batch))
                val_losses[step] = loss_fn(model(vx)[0], vy).item()

    run = train_one_process(model, batches(), optimizer=lambda params: torch.optim.AdamW(params, **adamw_kwargs(args)),
                            loss_fn=lambda output, y: loss_fn(output[0], y), micro_batches=micro_batches,
                            clip=args.clip, fp32_masters=True, on_step=validate,
                            scheduler=lambda opt: lr_schedule(opt, args, extended_from))
    losses = {step: loss for step, loss in enumerate(run.losses, start=1)}
    final = {n: p.cpu() for n, p in run.final.items()}
    return RunResult(losses, final, val_losses=val_losses, sample=_sample_one_process(model, args) if args.sample else "")


def _sample_one_process(model: nn.Module, args: argparse.Namespace, prompt: bytes = b"ROMEO:\n") -> str:
    """What :func:`sample` writes, from the whole model on this process."""
    model.eval()
    idx = torch.tensor([list(prompt)], device=args.device)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _ in range(args.sample):
            logits = model(idx[:, -args.block_size:])[0][0, -1].double() / 0.8  # temperature 0.8
            idx = torch.cat([idx, torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=g)[None].to(idx.device)], 1)
    return _text(idx[0].tolist())


@record  # under torchrun: the failing rank's traceback in torchrun's summary, naming the root cause
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.mesh == "auto":  # planned here, once, before any launch: the ranks get the chosen flags
        argv = plan_mesh(args, argv)
        args = parse_args(argv)
    if args.estimate:  # before any launch: one process, nothing allocated
        try:
            print(estimate.table(memory_estimate(args)))
        except (NotImplementedError, ValueError) as error:  # a layout it cannot estimate (yet), or a bad spec
            raise SystemExit(f"error: --estimate: {error}") from None
        return 0
    if "TORCHELASTIC_RUN_ID" not in os.environ and "RANK" not in os.environ:
        relaunch_under_torchrun(args, argv)
    try:
        result = train(args)
    except Exception:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            raise
        rank, lost = dist.get_rank(), lost_ranks(args.timeout)  # a peer gone (torchrun restarts the job), or a bug
        shutdown(abort=True)  # the others' shutdown() names this rank and its error; no wait
        if lost == []:
            raise
        what = f"rank(s) {lost}" if lost else "a peer, and the store with it (its node is gone)"
        print(f"rank {rank}: lost {what} within --timeout {args.timeout:g}s; exiting so that torchrun can restart "
              "the job", file=sys.stderr)
        return 1
    rank = dist.get_rank()
    shutdown()  # every rank done, the work in flight finished, the groups gone: the process exits 0
    ok = True
    if rank == 0:  # single-process work from here on, so the others need not wait (nor time out)
        report.finish(result, args)
        if args.memory_check:
            report.memory_check(result.tensor_peak, memory_estimate(args))
        if args.compare_single_device:
            ok = report.compare(result, args, lambda k, last: train_single_device(args, k, last))
        if result.sample:
            report.sample(result.sample)
        if args.export_hf:  # the last checkpoint this run wrote, as a transformers folder
            print(f"transformers checkpoint: {export_hf(args.checkpoint_dir, args.export_hf)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
