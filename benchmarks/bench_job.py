"""The GPT job end to end: ndweave's composition against the same composition from torch's own pieces.

    python benchmarks/bench_job.py             # GPT and HF Llama tiny, DP x TP (4 ranks) and PP x DP x TP (8)
    python benchmarks/bench_job.py --models nanogpt --meshes pp=2,dp=2,tp=2 --profile /tmp/job.prof
    python benchmarks/bench_job.py --compile   # each block compiled on both sides, and ours eager beside them
    python benchmarks/bench_job.py --quick     # tiny sizes, one round: a smoke test

Ours is the job's own functions (``ndweave_gpt.build``, imported, not copied): ``build_model`` ->
``parallelize`` (pipeline cut by FQN, the zoo's TP+SP plan per stage chunk: ``nanogpt``, or
``hf_llama`` for ``--model hf:llama``; ``ndweave.ddp`` on DP, ``PipeEngine``) -> ``build_optimizer``
(``DistributedOptimizer``: ZeRO-1 AdamW, global-norm clip, the job's lr schedule) ->
``CheckpointManager.save``.

Theirs is what a torch-native user writes for the same job, in the same processes, on the same
model (``build_model``, same seed), data (``TextData``, same positions), mesh layout and lr schedule:

* TP+SP: ``torch.distributed.tensor.parallel.parallelize_module`` with torchtitan's layout, the zoo
  plan's equivalent: the token embedding row-wise (vocab-parallel) into ``Shard(1)``, GPT's ``wpe``
  replicated and its output sliced to ``Shard(1)`` (``distribute_module``), ``SequenceParallel``
  norms, one all-gather per attention / MLP input (``PrepareModuleInput``), q/k/v and the MLP's input
  projections column-wise, the output projections row-wise into ``Shard(1)``, ``lm_head``
  column-wise with its logits gathered. The residual stream is a plain tensor holding this rank's
  part of the sequence (torchtitan's way); GPT's tie ``lm_head.weight is wte.weight`` is made again
  after sharding (``parallelize_module`` breaks it).
* DP: FSDP2 ``fully_shard`` per block and on the stage, over the DP sub-mesh,
  ``reshard_after_forward=False`` (ZeRO-2: parameters stay gathered from forward to backward, grads
  reduce-scattered, optimizer state sharded). ndweave's is ZeRO-1 (whole grads per DP rank,
  reduce-scattered into the optimizer's range, parameters all-gathered after the step). torch's
  ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``) rejects DTensor parameters, so it cannot carry TP.
* PP: ``torch.distributed.pipelining.PipelineStage`` over each stage's modules, built by hand with
  the blocks ndweave's cut gave that stage (their FQNs kept), and the same schedule class; a tied
  embedding's grads summed over the PP group between the first and last stage (Megatron's embedding
  all-reduce), the clip's norm summed over PP (torchtitan's ``clip_grad_norm_``).
* Optimizer: ``torch.optim.AdamW(fused=True)`` (torchtitan's default; ``--torch-adamw`` foreach, or
  default: what ``AdamW()`` picks, on CPU the per-parameter loop), the job's hyper-parameters and
  ``LambdaLR``; clip by ``get_total_norm`` + ``clip_grads_with_norm_`` (torchtitan's way).
* Checkpoint: ``dcp.save`` of ``get_state_dict(model, optimizer)``; ours saves the same two.

Timed: one job round = ``--steps`` training steps then one checkpoint save; rounds interleaved
ours / theirs (``common.interleaved``); the figure is the busiest rank's CPU time per step (the
save included, spread over the round's steps), the save's own CPU time beside it. At one pipeline
stage (DP x TP) both sides run each DP rank's batch whole; at PP > 1 in ``--micro-batches``.

Parity, checked before timing and failing loudly: both compositions built in float64 train
``--parity-steps`` steps and their losses must agree to ``STRICT`` (1e-9 relative: any difference in
sharding, scaling, clipping or the optimizer moves them far more; here they come out bit-equal).
The timed fp32 runs' losses are compared too, against a bound measured in the same run: ``SAFETY``
(20) times how far fp32 moves the loss from float64 over the parity steps, per step trained.

``--compile``: each side compiles each block (inductor): ours through the job's ``--compile`` (after
the plan, before DDP), theirs with ``block.compile()`` after ``parallelize_module`` and before
``fully_shard`` (torchtitan's order); ours eager runs as a third side, so one run gives compiled ours
against compiled torch and against ours eager, and the compile time (the warm-up's extra time over ours
eager's). Parity then holds each compiled side's float64 losses to ours eager within ``COMPILED_BOUND``
(inductor fuses transformers' float32 norms otherwise); a torch side that departs or fails is reported
and ours is timed against ours eager alone.

``--profile PATH``: after the timing, ``--profile-steps`` more steps of each side under cProfile on
every rank; prints, for the rank busiest on ours, self time by area (DTensor, torch's Python
dispatch, torch's pipelining, each ndweave package, C++...), ndweave's own functions by cumulative
time, and the top functions; the stats in ``PATH.<model>.<mesh>.<side>.<rank>``.

``--world-sizes`` (what ``run_all.py`` passes every benchmark) is not used: the meshes are
``--meshes``, the job's 4- and 8-rank layouts.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import logging
import math
import os
import pstats
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from common import Row, add_common_args, close, emit, init_rank, interleaved, spawn
from ndweave.checkpoint import DataPosition
from ndweave_gpt.build import (adamw_kwargs, build_mesh, build_model, build_optimizer, data_mean, data_rank, loss_fn,
                               lr_schedule, parallelize)
from ndweave_gpt.config import parse_args
from ndweave_gpt.data import TextData

#: --compile's third side: ours eager, against which ours compiled is timed too
EAGER = "ndweave eager"
#: --compile: how far (relative) a compiled side's float64 losses may be from ours eager
COMPILED_BOUND = 1e-7


def _job_args(spec: str, model: str, args, dtype: str, micro_batches: int, compiled: bool = False):
    hf = ["--config", args.hf_config] if model != "nanogpt" else []
    return parse_args([*(["--compile"] if compiled else []),
        "--model", model, *hf, "--mesh", spec, "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
        "--n-head", str(args.n_head),
        "--block-size", str(args.block_size), "--global-batch", str(args.global_batch),
        "--micro-batches", str(micro_batches), "--schedule", args.schedule, "--dtype", dtype,
        "--timeout", "600", "--quiet", "--plot", "", "--metrics", "", "--device", args.device])


# ----------------------------------------------------------------------------------------- ours
class Ours:
    """The job's own composition (``ndweave_gpt.build``'s functions)."""

    def __init__(self, a, mesh, ckpt_dir: str):
        from ndweave.checkpoint import CheckpointManager

        self.a, self.mesh = a, mesh
        model = build_model(a)
        job = parallelize(model, mesh, a)
        self.chunks, self.engine = job.chunks, job.engine
        del model
        gc.collect()
        self.optimizer, self.scheduler = build_optimizer(self.chunks, a)
        self.manager = CheckpointManager(ckpt_dir, keep_last=1)
        self.saves = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = self.engine(x, y).detach().to(torch.float64)
        self.optimizer.step()
        self.scheduler.step()
        return data_mean(loss, self.mesh)

    def save(self) -> None:
        self.saves += 1
        self.manager.save(self.saves, {"model": self.chunks, "optimizer": self.optimizer})

    def stage_layout(self) -> tuple[list[int], bool, bool]:
        """The blocks this rank's stage holds, and whether it holds the embeddings / the head."""
        family = FAMILIES[self.a.model.name]
        names = [n for chunk in self.chunks for n, _ in chunk.named_parameters(remove_duplicate=False)]
        prefix, embedding = f"{family.names.blocks}.", f"{family.names.embedding}."
        blocks = sorted({int(n[len(prefix):].split(".")[0]) for n in names if n.startswith(prefix)})
        return blocks, any(n.startswith(embedding) for n in names), any(n.endswith("lm_head.weight") for n in names)


# ---------------------------------------------------------------------------------------- theirs
class GPTStage(nn.Module):
    """Some of model.py's GPT, its FQNs kept: the embeddings (first stage), blocks, the head (last)."""

    def __init__(self, model: nn.Module, blocks: list[int], first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        parts: dict[str, nn.Module] = {}
        if first:
            parts.update(wte=model.transformer.wte, wpe=model.transformer.wpe, drop=model.transformer.drop)
        parts["h"] = nn.ModuleDict({str(i): model.transformer.h[i] for i in blocks})
        if last:
            parts["ln_f"] = model.transformer.ln_f
        self.transformer = nn.ModuleDict(parts)
        if last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], dtype=torch.long, device=x.device).unsqueeze(0)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))
        for block in self.transformer.h.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.transformer.ln_f(x))
        return x


@dataclass(frozen=True)
class Names:
    """Where a decoder's parts are, for its torch TP+SP plan (``tp_plan``)."""

    embedding: str
    blocks: str
    norms: tuple[str, str]
    """Each block's norms before attention and before the MLP."""
    attention: str
    qkv: tuple[str, ...]
    attention_out: str
    mlp: str
    mlp_in: tuple[str, ...]
    mlp_out: str
    final_norm: str
    attention_kwarg: str | None = None
    """The keyword the block hands attention its input by (None: the first positional argument)."""


GPT_NAMES = Names("transformer.wte", "transformer.h", ("ln_1", "ln_2"), "attn", ("q_proj", "k_proj", "v_proj"),
                  "c_proj", "mlp", ("c_fc",), "c_proj", "transformer.ln_f")
LLAMA_NAMES = Names("model.embed_tokens", "model.layers", ("input_layernorm", "post_attention_layernorm"),
                    "self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj", "mlp", ("gate_proj", "up_proj"),
                    "down_proj", "model.norm", attention_kwarg="hidden_states")


def tp_plan(names: Names, blocks: list[int], first: bool, last: bool) -> dict[str, Any]:
    """torch's TP+SP plan for a stage holding ``blocks`` (and the embedding / the head), the zoo plan's
    layout in torchtitan's style: the residual stream a plain tensor holding this rank's part of the
    sequence, each norm ``SequenceParallel``, its output all-gathered once per attention / MLP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    # (nanoGPT's attention takes the document mask beside the stream: attn(x, attention_mask), None unpacked)
    gather_kwarg = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)) \
        if names.attention_kwarg is None else PrepareModuleInput(
        input_kwarg_layouts={names.attention_kwarg: Shard(1)},
        desired_input_kwarg_layouts={names.attention_kwarg: Replicate()})
    plan: dict[str, Any] = {}
    if first:
        plan[names.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    for i in blocks:
        block = f"{names.blocks}.{i}"
        attention, mlp = f"{block}.{names.attention}", f"{block}.{names.mlp}"
        plan.update({f"{block}.{norm}": SequenceParallel() for norm in names.norms})
        plan.update({attention: gather_kwarg, mlp: gather})
        plan.update({f"{attention}.{p}": ColwiseParallel() for p in names.qkv})
        plan.update({f"{mlp}.{p}": ColwiseParallel() for p in names.mlp_in})
        plan[f"{attention}.{names.attention_out}"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"{mlp}.{names.mlp_out}"] = RowwiseParallel(output_layouts=Shard(1))
    if last:
        plan[names.final_norm] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def replicate_positions(wpe: nn.Module, tp_mesh) -> None:
    """``wpe`` as the nanogpt plan has it: its table replicated over TP (a DTensor, as FSDP2 and the
    clip's norm need every parameter on the same mesh), the positions looked up whole and the output
    sliced to this rank's part of the sequence (``distribute_module``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

    distribute_module(
        wpe, tp_mesh,
        input_fn=lambda _, inputs, mesh: tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                                               for t in inputs),
        output_fn=lambda _, output, mesh: output.redistribute(mesh, [Shard(1)]).to_local())


class LlamaStage(nn.Module):
    """Some of transformers' LlamaForCausalLM, its FQNs kept: the embedding (first stage), decoder
    layers, the final norm and head (last); the rotary table on every stage, as LlamaModel calls it."""

    def __init__(self, model: nn.Module, blocks: list[int], first: bool, last: bool, tp: int):
        super().__init__()
        self.first, self.last, self.tp = first, last, tp
        inner = nn.Module()
        if first:
            inner.embed_tokens = model.model.embed_tokens
        inner.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in blocks})
        inner.rotary_emb = model.model.rotary_emb
        if last:
            inner.norm = model.model.norm
        self.model = inner
        if last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a received activation holds this rank's 1/tp of the sequence (sequence parallel)
        h, tokens = (self.model.embed_tokens(x), x.shape[1]) if self.first else (x, x.shape[1] * self.tp)
        positions = torch.arange(tokens, device=h.device).unsqueeze(0)
        rotary = self.model.rotary_emb(h, position_ids=positions)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.last:
            h = self.lm_head(self.model.norm(h))
        return h


@dataclass(frozen=True)
class Family:
    """How the torch side builds one model family's stage."""

    names: Names
    stage: Callable[..., nn.Module]
    """``stage(model, blocks, first, last, tp)``."""
    positions: bool = False
    """A learned position table (``wpe``) to replicate over TP (``replicate_positions``)."""


FAMILIES = {
    "nanogpt": Family(GPT_NAMES, lambda model, blocks, first, last, _: GPTStage(model, blocks, first, last),
                      positions=True),
    "hf:llama": Family(LLAMA_NAMES, LlamaStage),
}


class Theirs:
    """The same job from torch's pieces (see the module docstring)."""

    def __init__(self, a, tmesh, layout: tuple[list[int], bool, bool], micro_batches: int, device: torch.device,
                 ckpt_dir: str, optimizer: str = "fused", compiled: bool = False):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        self.a, self.tmesh, self.device, self.ckpt_dir = a, tmesh, device, ckpt_dir
        # the groups held, not sliced from the mesh each step (a DeviceMesh slice costs milliseconds)
        self.pp, self.dp = tmesh["pp"].size(), tmesh["dp"].size()
        self.pp_group, self.dp_group = tmesh["pp"].get_group(), tmesh["dp"].get_group()
        blocks, self.first, self.last = layout
        family, tp = FAMILIES[a.model.name], tmesh["tp"].size()
        model = build_model(a)
        names = family.names
        tied = model.lm_head.weight is model.get_submodule(names.embedding).weight
        stage = family.stage(model, blocks, self.first, self.last, tp)
        del model
        if tp > 1:
            parallelize_module(stage, tmesh["tp"], tp_plan(names, blocks, self.first, self.last))
            if self.first and family.positions:
                replicate_positions(stage.transformer.wpe, tmesh["tp"])
            if tied and self.first and self.last:  # parallelize_module made two parameters of the tied one
                stage.lm_head.weight = stage.get_submodule(names.embedding).weight
        for block in stage.get_submodule(names.blocks).values():
            if compiled:  # torchtitan's order: TP, then each block compiled, then FSDP
                block.compile()
            fully_shard(block, mesh=tmesh["dp"], reshard_after_forward=False)
        fully_shard(stage, mesh=tmesh["dp"], reshard_after_forward=False)
        # the tied weight's two copies when the pipeline split them (FSDP2's sharded parameters): their
        # grads are summed over PP, and the last stage's copy counts not in the clip's norm
        self.tied = ((stage.get_submodule(names.embedding).weight if self.first else stage.lm_head.weight)
                     if tied and self.pp > 1 and (self.first or self.last) else None)
        self.stage = stage
        self.params = [p for p in stage.parameters()]
        self.norm_params = [p for p in self.params if not (self.tied is not None and self.last and p is self.tied)]
        kind = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[optimizer]
        self.optimizer = torch.optim.AdamW(self.params, **adamw_kwargs(a), **kind)
        self.scheduler = lr_schedule(self.optimizer, a)
        self.schedule = None
        if self.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[a.parallel.schedule]
            pipe = PipelineStage(stage, tmesh["pp"].get_local_rank(), self.pp, device, group=tmesh["pp"].get_group())
            self.schedule = cls(pipe, n_microbatches=micro_batches, loss_fn=loss_fn)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        if self.schedule is None:
            loss = loss_fn(self.stage(x), y)
            loss.backward()
            loss = loss.detach().to(torch.float64)
        else:
            losses: list[torch.Tensor] = []
            if self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
            loss = (torch.stack(losses).to(torch.float64).mean() if self.last
                    else torch.zeros((), dtype=torch.float64, device=self.device))
            dist.all_reduce(loss, group=self.pp_group)  # the last stage's, on every stage
            if self.tied is not None:
                with torch.no_grad():
                    dist.all_reduce(self.tied.grad.to_local(), group=self.pp_group)
        self._clip()
        self.optimizer.step()
        self.scheduler.step()
        dist.all_reduce(loss, group=self.dp_group)
        return loss.item() / self.dp

    def _clip(self) -> None:
        from torch.distributed.tensor import DTensor

        if not self.a.training.clip:
            return
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.norm_params if p.grad is not None], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.pp > 1:
            norm = norm ** 2
            dist.all_reduce(norm, group=self.pp_group)
            norm = norm.sqrt()
        torch.nn.utils.clip_grads_with_norm_(self.params, self.a.training.clip, norm)

    def save(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.stage, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=self.ckpt_dir)


# ------------------------------------------------------------------------------------ the ranks
def _pair(spec: str, model: str, args, dtype: str, tmesh, device, tmp: str):
    """Ours and theirs for ``spec`` in ``dtype``, from the same model, with one data stream each
    (``--compile``: both with their blocks compiled, and ours eager as a third side)."""
    pp = tmesh["pp"].size()
    micro = args.micro_batches if pp > 1 else 1  # one stage: a plain step on each side, no accumulation
    a = _job_args(spec, model, args, dtype, micro, args.compile)
    mesh = build_mesh(a)
    ours = Ours(a, mesh, os.path.join(tmp, f"ours-{dtype}"))
    theirs = Theirs(a, tmesh, ours.stage_layout(), micro, device, os.path.join(tmp, f"theirs-{dtype}"),
                    args.torch_adamw, args.compile)
    sides = {"ndweave": ours, "torch": theirs}
    if args.compile:
        sides[EAGER] = Ours(_job_args(spec, model, args, dtype, micro), mesh, os.path.join(tmp, f"eager-{dtype}"))
    dp_rank, dp_size = data_rank(mesh)
    feeds = {}
    for name, side in sides.items():
        data, position = TextData(a.model.block_size, a.training.seed), DataPosition()

        def feed(side=side, data=data, position=position) -> float:
            x, y = (t.to(device) for t in data.batch(position, a.data.global_batch, dp_rank, dp_size))
            position.advance(a.data.global_batch)
            return side.step(x, y)
        feeds[name] = feed
    return sides, feeds


def _worker(rank: int, world: int, port: int, spec: str, model: str, args, tmp: str, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from ndweave.mesh.testing import STRICT

    device = init_rank(rank, world, port, args.device, args.threads)
    _quiet()
    if args.compile:
        # both sides compile the same block classes in one process: dynamo skips guards on module hooks
        # by default, so one side's graph (its TP hooks traced in) would serve the other's blocks
        torch._dynamo.config.skip_nnmodule_hook_guards = False
    sizes = dict(item.split("=") for item in spec.split(","))
    pp, dp, tp = (int(sizes.get(d, 1)) for d in ("pp", "dp", "tp"))
    tmesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    result: dict[str, Any] = {}

    # parity: float64, strict
    sides, feeds = _pair(spec, model, args, "float64", tmesh, device, tmp)
    exact = {name: [feed() for _ in range(args.parity_steps)] for name, feed in feeds.items()}
    del sides, feeds
    gc.collect()
    result["float64"] = exact
    if args.compile:
        # compiled, each side is held to ours eager: inductor fuses what transformers computes in float32
        # (its norms) otherwise than eager does (~1e-9); a wrong grad moves the next loss by far more
        for name in ("ndweave", "torch"):
            worst = _worst(exact[name], exact[EAGER])
            if worst > COMPILED_BOUND:
                result.setdefault("departs", {})[name] = worst
        if "ndweave" in result.get("departs", {}):
            raise AssertionError(f"{model} {spec}: compiled, ours departs from ours eager (rel {worst:.3g}): "
                                 f"{exact['ndweave']} against {exact[EAGER]}")
    elif _worst(exact["ndweave"], exact["torch"]) > STRICT.rtol:
        raise AssertionError(f"{model} {spec}: float64 losses differ beyond STRICT (rel "
                             f"{_worst(exact['ndweave'], exact['torch']):.3g}): ours {exact['ndweave']}, torch "
                             f"{exact['torch']}")

    # timing: fp32
    sides, feeds = _pair(spec, model, args, "fp32", tmesh, device, tmp)
    losses: dict[str, list[float]] = {name: [] for name in sides}
    save_cpu: dict[str, list[float]] = {name: [] for name in sides}

    def job_round(name: str, steps: int) -> None:
        for _ in range(steps):
            losses[name].append(feeds[name]())
        c0 = time.process_time()
        sides[name].save()
        save_cpu[name].append(time.process_time() - c0)

    warmup_s: dict[str, float] = {}
    for name in list(sides):  # warm-up: the first steps (shape agreement, caches, compiling) and a first save
        started = time.perf_counter()
        try:
            job_round(name, args.warmup)
            warmup_s[name] = time.perf_counter() - started
        except Exception as failed:  # noqa: BLE001 (compiled, torch's side may fail where ours runs: said)
            if not (args.compile and name == "torch"):
                raise
            result["torch_failed"] = f"{type(failed).__name__}: {str(failed).splitlines()[0][:160]}"
            del sides[name], feeds[name], losses[name]
    result["warmup_s"] = warmup_s
    save_cpu = {name: [] for name in sides}
    timing = interleaved({name: (lambda name=name: job_round(name, args.steps)) for name in sides}, device,
                         args.rounds, 1)
    result["timing"] = {k: (t.wall / args.steps, t.cpu / args.steps) for k, t in timing.items()}
    result["save_cpu"] = {k: sorted(v)[len(v) // 2] for k, v in save_cpu.items()}
    result["fp32"] = losses
    if args.profile:
        where = f"{args.profile}.{model.replace(':', '_')}.{spec}"
        result["profile"] = {name: _profile(feeds[name], args, f"{where}.{name}.{rank}") for name in sides}
    everyone: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, result)
    if rank == 0:
        queue.put(everyone)
    close()


def _compiled_against_eager(model: str, spec: str, args, r0: dict, world: int, note: str = "") -> list[Row]:
    """--compile: ours compiled against ours eager (the busiest rank's CPU), printed; its row. The
    compile time is rank 0's warm-up (its first steps and save) less ours eager's warm-up, with
    inductor's on-disk cache as this run found it."""
    (ours, ours_cpu), (eager, eager_cpu) = r0["timing"]["ndweave"], r0["timing"][EAGER]
    warm = r0["warmup_s"]
    compiling = {name: warm[name] - warm[EAGER] for name in ("ndweave", "torch") if name in warm}
    note = "; ".join([f"compiling: ours {compiling['ndweave']:.1f} s"
                      + (f", torch {compiling['torch']:.1f} s" if "torch" in compiling else "")] + ([note] if note else []))
    print(f"{_describe(model, args):>16} | {spec:>14} | compiled / eager, ours: wall {ours / eager:.2f}, busiest rank's "
          f"CPU {ours_cpu / eager_cpu:.2f} ({ours_cpu * 1e3:.1f} / {eager_cpu * 1e3:.1f} ms); {note}", flush=True)
    return [Row("ndweave job compiled (--compile)", f"the same job eager, {_describe(model, args)}, "
                f"{spec.replace(',', ' x ')}", world, ours / eager, ours_cpu / eager_cpu,
                note=f"CPU ms/step compiled {ours_cpu * 1e3:.1f}, eager {eager_cpu * 1e3:.1f} ({args.steps} steps + 1 "
                     f"checkpoint per round); {note}")]


def _worst(ours: list[float], theirs: list[float]) -> float:
    """The largest relative difference of two runs' losses, step by step."""
    return max(abs(o - t) / max(abs(o), 1e-300) for o, t in zip(ours, theirs))


def _quiet() -> None:
    """Leave out torch's warnings about what this benchmark does on purpose: a stage returning a
    view (nothing changes it in place), dcp overwriting its last save, the clip norm's two
    all-reduces over a 2-D mesh (torchtitan's code path as written)."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _profile(feed: Callable[[], float], args, path: str) -> float:
    """``--profile-steps`` steps of ``feed`` under cProfile, dumped to ``path``; the CPU seconds they took."""
    profiler = cProfile.Profile(time.process_time)
    dist.barrier()
    c0 = time.process_time()
    profiler.enable()
    for _ in range(args.profile_steps):
        feed()
    profiler.disable()
    cpu = time.process_time() - c0
    profiler.dump_stats(path)
    return cpu


# ------------------------------------------------------------------------------------ the profile
#: Where a function's self time is counted: the first area one of whose paths its file's path holds.
AREAS = (
    ("ndweave.pipeline", ("/ndweave/pipeline/",)), ("ndweave.dmodule", ("/ndweave/dmodule/",)),
    ("ndweave.ddp", ("/ndweave/ddp/",)), ("ndweave.optim", ("/ndweave/optim/",)),
    ("ndweave.checkpoint", ("/ndweave/checkpoint/",)), ("ndweave.mesh", ("/ndweave/mesh/",)),
    ("torch pipelining", ("/torch/distributed/pipelining/",)),
    ("torch TP styles (parallelize_module)", ("/torch/distributed/tensor/parallel/",)),
    ("DTensor (sharding propagation, redistribute)", ("/torch/distributed/tensor/",)),
    ("torch's Python dispatch (_ops, _library, dynamo-disable wrappers)",
     ("/torch/_ops.py", "/torch/_library/", "/torch/_dynamo/", "/torch/_compile.py", "/torch/_opaque_base.py")),
    ("FSDP2", ("/torch/distributed/fsdp/",)), ("torch.optim", ("/torch/optim/",)),
    ("c10d and DeviceMesh (Python)", ("/torch/distributed/",)), ("autograd (Python)", ("/torch/autograd/",)),
    ("torch.nn modules and hooks", ("/torch/nn/",)), ("torch.fx", ("/torch/fx/",)),
    ("torch, other Python", ("/torch/",)),
    ("the job (ndweave_gpt)", ("/ndweave_gpt/",)),
)


def _area(filename: str) -> str:
    if filename == "~":  # a builtin: ATen ops and kernels, the C++ autograd engine, c10d waits
        return "C++ (ATen ops and kernels, autograd engine, c10d waits)"
    return next((area for area, parts in AREAS if any(part in filename for part in parts)), "other Python")


def profile_summary(path: str, steps: int, top: int = 14) -> str:
    """One rank's profile per step: self time by area, the functions of ndweave and the job with the
    most cumulative time, and the top functions by self time."""
    stats = pstats.Stats(path)
    areas: dict[str, float] = {}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        areas[_area(filename)] = areas.get(_area(filename), 0.0) + tottime
    total = sum(areas.values())
    lines = [f"  self time per step by area (total {total / steps * 1e3:.1f} ms/step):"]
    lines += [f"    {area:<66} {seconds / steps * 1e3:8.2f} ms  {seconds / total:6.1%}"
              for area, seconds in sorted(areas.items(), key=lambda kv: -kv[1]) if seconds / total >= 0.001]
    # the step's own frames (the engine, the stage forward and backward, the model) hold nearly all of it
    ours = sorted(((cum, tot, calls, f"{Path(filename).name}:{line}({name})")
                   for (filename, line, name), (_, calls, tot, cum, _) in stats.stats.items()
                   if ("/ndweave/" in filename or "/ndweave_gpt/" in filename) and not filename.endswith("nanogpt.py")
                   and cum < 0.25 * total), reverse=True)
    if ours:
        lines.append("  ndweave / job functions by cumulative time per step, under 25% of it (ms cumulative, ms self, "
                     "calls/step):")
        lines += [f"    {cum / steps * 1e3:8.2f} {tot / steps * 1e3:7.2f} {calls / steps:7.1f}  {where}"
                  for cum, tot, calls, where in ours[:top]]
    lines.append("  top functions by self time per step (ms self, ms cumulative, calls/step):")
    rows = sorted(((tot, cum, calls, f"{Path(filename).name}:{line}({name})")
                   for (filename, line, name), (_, calls, tot, cum, _) in stats.stats.items()), reverse=True)
    lines += [f"    {tot / steps * 1e3:8.2f} {cum / steps * 1e3:8.2f} {calls / steps:7.1f}  {where}"
              for tot, cum, calls, where in rows[:top]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- main
def _loss_bound(results: list[dict]) -> tuple[float, float]:
    """(largest fp32 loss difference ours vs torch, the bound it is held to): ``SAFETY`` x the largest
    fp32-vs-float64 difference of either side over the parity steps, times the step number (rounding
    differences grow with the steps trained), floored at a few fp32 epsilons of the loss."""
    from ndweave.mesh.testing.parity import SAFETY

    r = results[0]
    steps = len(r["float64"]["ndweave"])
    drift = max(abs(r["fp32"][k][i] - r["float64"][k][i]) for k in ("ndweave", "torch") for i in range(steps))
    floor = 8 * torch.finfo(torch.float32).eps * max(abs(v) for v in r["fp32"]["ndweave"])
    diffs = [abs(o - t) / (i + 1) for i, (o, t) in enumerate(zip(r["fp32"]["ndweave"], r["fp32"]["torch"]))]
    return max(diffs), max(SAFETY * drift, floor)


def _describe(model: str, args) -> str:
    if model == "nanogpt":
        return f"GPT {args.n_layer} x {args.n_embd}"
    return f"HF {model[3:].capitalize()} {args.hf_config}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--models", nargs="+", choices=list(FAMILIES), default=list(FAMILIES),
                        help="the job's --model: its nanogpt GPT, transformers' Llama (--hf-config)")
    parser.add_argument("--hf-config", default="tiny", help="the hf: model's --config preset")
    parser.add_argument("--meshes", nargs="+", default=["dp=2,tp=2", "pp=2,dp=2,tp=2"])
    parser.add_argument("--n-layer", type=int, default=4, help="nanogpt's")
    parser.add_argument("--n-embd", type=int, default=128, help="nanogpt's")
    parser.add_argument("--n-head", type=int, default=4, help="nanogpt's")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4, help="per DP rank, through the pipeline (PP > 1)")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--steps", type=int, default=3, help="training steps per timed round (then one save)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="steps before timing (then one save)")
    parser.add_argument("--parity-steps", type=int, default=3, help="float64 steps whose losses must agree strictly")
    parser.add_argument("--torch-adamw", choices=["default", "foreach", "fused"], default="fused",
                        help="torch's AdamW: fused (torchtitan's default), foreach, or default (what AdamW() "
                             "picks: on CPU the per-parameter loop)")
    parser.add_argument("--profile", metavar="PATH", default="", help="profile each side after timing (cProfile)")
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny model and rounds: a smoke test, not figures")
    parser.add_argument("--compile", action="store_true",
                        help="both sides compile each block (ours: the job's --compile; theirs: block.compile() "
                             "after TP, before FSDP, torchtitan's order), and ours eager is timed beside them")
    args = parser.parse_args()
    if args.compile:  # (ours runs its first step eagerly and compiles at the second: both outside the timing)
        args.warmup = max(args.warmup, 2)
    if args.quick:
        args.n_layer, args.n_embd, args.n_head, args.block_size, args.global_batch = 2, 32, 2, 16, 8
        args.micro_batches, args.steps, args.rounds, args.warmup, args.parity_steps = 2, 1, 1, 1, 2
    if args.parity_steps > args.warmup + args.steps * args.rounds:
        parser.error("--parity-steps must not exceed the steps timed (warm-up included): their fp32 losses are "
                     "compared")
    print(f"GPT job: {args.block_size} tokens x {args.global_batch} samples per step; {args.micro_batches} "
          f"micro-batches per DP rank at PP > 1 ({args.schedule}); {args.steps} steps + 1 checkpoint per round, "
          f"{args.rounds} rounds; "
          f"torch AdamW {args.torch_adamw}; device {args.device}; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'model':>16} | {'mesh':>14} | {'ours ms':>8} | {'torch ms':>8} | {'ratio':>5} | {'ours CPU ms':>11} | "
          f"{'torch CPU ms':>12} | {'ratio':>5} | {'save CPU ours/torch ms':>22} | {'f64 loss rel':>12} | "
          f"{'fp32 diff/bound':>16}", flush=True)
    rows = []
    for model in args.models:
        for spec in args.meshes:
            rows.extend(_run(model, spec, args))
    print(f"(ratio = ours / torch: wall and the busiest rank's CPU time per step, medians of {args.rounds} interleaved "
          f"rounds of {args.steps} steps + 1 checkpoint; load average {os.getloadavg()[0]:.1f} at the end)")
    emit(rows, args.json)


def _run(model: str, spec: str, args) -> list[Row]:
    """One model on one mesh: spawned, checked, printed; its rows (``--compile``: two)."""
    rows: list[Row] = []
    world = math.prod(int(item.split("=")[1]) for item in spec.split(","))
    tmp = tempfile.mkdtemp(prefix="bench_job_")
    try:
        results = spawn(_worker, world, spec, model, args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r0 = results[0]
    if "torch_failed" in r0:  # (--compile: torch's compiled side failed; ours compiled against ours eager only)
        return _compiled_against_eager(model, spec, args, r0, world, f"torch's compiled side failed: {r0['torch_failed']}")
    (ours, ours_cpu), (theirs, theirs_cpu) = r0["timing"]["ndweave"], r0["timing"]["torch"]
    save = {k: max(r["save_cpu"][k] for r in results) for k in ("ndweave", "torch")}
    exact = r0["float64"]
    rel = max(abs(o - t) / abs(o) for o, t in zip(exact["ndweave"], exact["torch"]))
    diff, bound = _loss_bound(results)
    # the steps alone, roughly: the busiest rank's round less the slowest save, per step
    steps_only = (ours_cpu - save["ndweave"] / args.steps) / (theirs_cpu - save["torch"] / args.steps)
    print(f"{_describe(model, args):>16} | {spec:>14} | {ours * 1e3:>8.1f} | {theirs * 1e3:>8.1f} | "
          f"{ours / theirs:>5.2f} | {ours_cpu * 1e3:>11.1f} | {theirs_cpu * 1e3:>12.1f} | "
          f"{ours_cpu / theirs_cpu:>5.2f} | "
          f"{save['ndweave'] * 1e3:>10.1f} / {save['torch'] * 1e3:<9.1f} | {rel:>12.2e} | {diff:.1e}/{bound:.1e}\n"
          f"{'':>16}   CPU ratio of the steps without the save: about {steps_only:.2f}\n"
          f"{'':>16}   float64 losses, ours: {' '.join(f'{v:.12f}' for v in exact['ndweave'])}\n"
          f"{'':>16}                  torch: {' '.join(f'{v:.12f}' for v in exact['torch'])}", flush=True)
    departs = r0.get("departs", {}).get("torch")
    if departs:
        print(f"{'':>16}   compiled, torch's side departs from ours eager by {departs:.1e} (float64, relative) "
              f"after a step: its grads are not eager's; its time is shown, its fp32 losses are not held", flush=True)
    elif diff > bound:
        raise SystemExit(f"{model} {spec}: the fp32 losses differ by {diff:.3g} per step trained, beyond the measured "
                         f"bound {bound:.3g}: ours {r0['fp32']['ndweave']}, torch {r0['fp32']['torch']}")
    if args.profile:
        busiest = max(range(world), key=lambda r: results[r]["profile"]["ndweave"])
        for name in ("ndweave", "torch"):
            cpu = results[busiest]["profile"][name]
            print(f"\nprofile {model} {spec}, {name}, rank {busiest} (the busiest on ours): "
                  f"{cpu / args.profile_steps * 1e3:.1f} ms CPU/step under cProfile")
            print(profile_summary(f"{args.profile}.{model.replace(':', '_')}.{spec}.{name}.{busiest}",
                                  args.profile_steps))
    pipe = f" + torch.distributed.pipelining ({args.schedule})" if "pp=" in spec else ""
    compiled = ", each block compiled" if args.compile else ""
    if args.compile:
        rows = _compiled_against_eager(model, spec, args, r0, world)
    return rows + [Row(
        f"ndweave job (ndweave_gpt){compiled}",
        f"torch parallelize_module TP+SP + FSDP2 (ZeRO-2){pipe} + dcp.save{compiled}, {_describe(model, args)}, "
        f"{spec.replace(',', ' x ')}",
        world, ours / theirs, ours_cpu / theirs_cpu,
        note=f"CPU ms/step ours {ours_cpu * 1e3:.1f}, torch {theirs_cpu * 1e3:.1f} ({args.steps} steps + 1 checkpoint "
             f"per round; the steps alone ~{steps_only:.2f}); save CPU ours {save['ndweave'] * 1e3:.0f}, torch "
             f"{save['torch'] * 1e3:.0f} ms; float64 losses rel {rel:.0e}"
             + (f"; torch compiled departs from eager by {departs:.0e}" if departs else ""))]


if __name__ == "__main__":
    main()
