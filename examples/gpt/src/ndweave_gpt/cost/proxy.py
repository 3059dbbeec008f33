"""``--mesh auto`` at scale: every layout priced from traces of three parts of the model, not of the
whole model per layout.

Every stage of every layout is made of the same parts: what runs before the blocks (the
embeddings), some blocks, and what runs after them (the final norm, the head, the loss). So the job's
model is built again with one block, cut into those three parts as three pipeline stages (one cut
per shape and CP size, before TP: the same for every TP size), and traced twice per TP size (per EP
size for a MoE model's experts over EP, its tokens routed evenly), and per CP size (a CP rank's
``block_size / cp`` tokens of each row, attention across CP, its exchanges over ``"CP"``): for
micro-batches of one and of two rows (everything a micro-batch holds or does is affine in its rows;
CP splits a row's tokens, not the rows). With activation checkpointing it is traced at one row
without TP, over one TP size and each EP size, per CP size: how much of a block's forward its
backward runs again, a prefix of it at any TP size. Each trace gives what a
part saves, its peak, what it receives and sends (``estimate.trace``) and the work of its forward
and backward (under ``step_time``'s work counter). A stage of a layout is then the sum of its parts: its saved bytes and
work add up, its temporaries are its largest part's. Which blocks a stage holds is the pipeline's
own split (``ndweave.pipeline.split.assign_stages``, the balance by parameters the traced cut keeps),
and from there every term is the full estimate's own function (``estimate.chunk_state``, ``state_terms``,
``estimate.activation_terms``, ``step_time.step_terms``): only the traces are shared; the DP x CP
ranks are the data ranks of the parameters and the optimizer's state. The ranks priced are one per
PP rank at each end of the DP, CP, EP and TP dims (a ZeRO range's padding and an uneven vocabulary's
rows fall on the last ones); the other ranks repeat one of those.

Held to the full estimates on layouts of the GPT, its MoE and HF Llama
(``tests/integration/test_integration_plan_fast.py``): peak 0.988-1.023, step 1.00-1.09 (CP layouts:
0.988-1.012 and 1.00-1.04; a part's peak at two rows, where its parameter-sized temporaries still
weigh, extended along the rows: a little under on the tiny test model, whose CP rows hold 16 tokens).
A 70B, 80-layer Llama is planned for 512 ranks on meta, nothing allocated. ``price_ahead`` prices all
of a plan's layouts at once on every core (forked copies of the process: the traces of each CP, EP and
TP size, then the layouts grouped by those sizes), with the same figures as pricing them one by one.

    pricer = Pricer(args, machine, build_model, sharding, loss_fn, bucket_size, optimizer_kwargs)
    pricer.peak_bytes(layout_args), pricer.step_seconds(layout_args)
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from ndweave.mesh import resolve_spec, torch_compat
from ndweave.plan.calibrate import Machine
from ndweave.plan.work import Work, WorkCounter
from ndweave.plan.estimate import MemoryTerm, RankMemory
from ndweave.pipeline import PipelineParallelPlan
from ndweave.pipeline.construct import ModelCut, cut_model
from ndweave.pipeline.cost import StageActivations
from ndweave.pipeline.plan import ResolvedPlan, resolve_plan
from ndweave.pipeline.split import assign_stages, model_layers
from ndweave_gpt.config import DIMS, DTYPES, JobConfig
from ndweave_gpt.cost.estimate import (StageBytes, activation_terms, chunk_buffers, chunk_state, data_bytes, local_shapes,
                                       parameters, peer_shapes, rank_actions, state_terms, tied_across_ranks,
                                       trace, traced_world)
from ndweave_gpt.cost.step_time import (host_seconds, named_group, optimizer_seconds, sharding_groups, stage_buffers,
                                        step_terms, sync_and_optimizer, work_seconds)

__all__ = ["Part", "Pricer"]

#: (CP, EP, TP) sizes: what a stage's parts are traced over, each a fake world of their product
Shard = tuple[int, int, int]


@dataclass(frozen=True)
class Part:
    """One part of the model (before the blocks, one block, after them) for one micro-batch."""

    activations: StageActivations
    """What it saves for backward, and its peak, as a pipeline stage of its own."""
    io: StageBytes
    """What it receives, sends, keeps for a split backward and (the last part) what its loss saves."""
    forward: float
    """Seconds of its forward on the machine, its TP collectives included (no host time per action)."""
    backward: float
    """Seconds of its backward, likewise."""
    tp_comm: float
    """Seconds of its TP collectives, forward and backward."""


@dataclass(frozen=True)
class _Traced:
    """What one part holds and does for one micro-batch, as traced (its collectives over ``"TP"``)."""

    activations: StageActivations
    io: StageBytes
    forward: Work
    backward: Work


@dataclass(frozen=True)
class _Stage:
    """What one stage of a layout holds: parts and parameters."""

    before: bool
    blocks: int
    after: bool
    names: list[str]
    """Its parameters' FQNs (a weight tied within the stage once)."""


class Pricer:
    """Prices the layouts of one job (``args`` but the layout's flags): peak memory of the busiest rank
    and the step's seconds, from the parts' traces, cached by what each depends on. The arguments
    are ``estimate.estimate_memory``'s and ``step_time.estimate_step_seconds``'s."""

    def __init__(self, args: JobConfig, machine: Machine, build_model: Callable[..., nn.Module],
                 sharding: Callable[[nn.Module, dict[str, int]], dict | None], loss_fn: Callable,
                 bucket_size: int | None, optimizer_kwargs: dict) -> None:
        self.args, self.machine, self.build_model, self.sharding = args, machine, build_model, sharding
        self.loss_fn, self.bucket_size, self.optimizer_kwargs = loss_fn, bucket_size, optimizer_kwargs
        self.model = build_model(args, "meta")
        self.layers = model_layers(self.model)
        self.before, self.after = _ends(self.model, self.layers)
        proxy = build_model(one_block(args), "meta")
        proxy_layers = model_layers(proxy)
        if _ends(proxy, proxy_layers) != (self.before, self.after):
            raise ValueError(f"the model with one block has other layers around its blocks: {proxy_layers}")
        # the proxy's stages: what runs before the block, the block, what runs after it
        self.split_points = [proxy_layers[self.before], proxy_layers[self.before + 1]]
        self._parts_plan = PipelineParallelPlan(schedule_type="gpipe", num_microbatches=3,
                                                split_points=self.split_points)
        self.data = data_bytes(args) if torch.device(args.parallel.device).type == "cpu" else 0
        self.optimizer = optimizer_seconds(machine, optimizer_kwargs, args.training.clip)
        # traces by what a stage is sharded over: (CP, EP, TP) sizes (the job's MoE layouts have tp = 1)
        self._traced: dict[Shard, list[list[_Traced]]] = {}
        self._recompute: dict[Shard, _Traced] = {}
        self._parts: dict[tuple[Shard, bool, int], list[Part]] = {}
        self._stages: dict[int, list[_Stage]] = {}
        self._plans: dict[tuple, dict | None] = {}
        self._shapes: dict[tuple, dict] = {}
        self._peers: dict[tuple, list] = {}
        self._state: dict[tuple, tuple] = {}
        self._terms: dict[tuple, tuple] = {}
        self._chunk_buffers: dict[tuple, tuple] = {}
        self._buffers: dict[tuple, tuple] = {}
        self._tied_names: dict[tuple, list[list[str]]] = {}
        self._proxies: dict[bool, nn.Module] = {}
        self._cuts: dict[tuple[bool, int, int], ModelCut] = {}
        self._ahead: dict[tuple, tuple[int, float | None]] = {}  # layout -> (peak, step): price_ahead's

    # ---- memory --------------------------------------------------------------------------------
    def peak_bytes(self, args: JobConfig) -> int:
        """The busiest rank's estimated peak for ``args``' layout."""
        ahead = self._ahead.get(_layout_key(args))
        return ahead[0] if ahead else max(r.peak for r in self.rank_memory(args))

    def rank_memory(self, args: JobConfig) -> list[RankMemory]:
        """The estimate of one rank per PP rank and end of each other dim (see the module docstring)."""
        sizes, resolved, stages, parts = self._layout(args)
        traced, io = self._composed(stages, parts)
        tied = self._tied(stages, resolved)
        ranks, activations = [], {}
        for coordinate in _representatives(sizes):
            terms, syncs = [MemoryTerm("data", self.data, "job")], {}
            for stage in resolved.stages_of(coordinate["PP"]):
                state, syncs[stage] = self._model_state(stages, stage, sizes, coordinate, args.parallel.zero_stage)
                terms += state
            shapes = self._local_shapes(sizes, coordinate)
            tied_grads = sum(shapes[n][0].numel() * parameters(self.model)[n].element_size()
                             for s in resolved.stages_of(coordinate["PP"]) for n in tied[s])
            # a PP rank's ranks at the ends of the other dims mostly hold the same: priced once
            key = (coordinate["PP"], tied_grads, tuple(syncs.items()))
            if key not in activations:
                activations[key] = activation_terms(resolved, traced, io, coordinate, tied_grads, syncs)
            ranks.append(RankMemory(coordinate, tuple(terms + activations[key])))
        return ranks

    def _tied(self, stages: list[_Stage], resolved: ResolvedPlan) -> list[list[str]]:
        key = (len(stages), resolved.pp_size, resolved.v_shaped)
        if key not in self._tied_names:
            self._tied_names[key] = tied_across_ranks(self.model, [s.names for s in stages], resolved)
        return self._tied_names[key]

    def _model_state(self, stages: list[_Stage], stage: int, sizes: dict[str, int], coordinate: dict[str, int],
                     zero_stage: int):
        # stages holding the same parts hold parameters of the same shapes, in the same order, whatever
        # the PP size; DP and CP ranks are alike as data ranks (row-major: DP x CP), whatever the split
        key = (_counts(stages[stage]), sizes["DP"] * sizes["CP"], sizes["EP"], sizes["TP"],
               coordinate["DP"] * sizes["CP"] + coordinate["CP"], coordinate["EP"], coordinate["TP"])
        if key not in self._state:  # one chunk state for either ZeRO stage
            shapes = self._local_shapes(sizes, coordinate)
            on_any_dp_rank = key[:4] + key[5:]
            if on_any_dp_rank not in self._chunk_buffers:
                self._chunk_buffers[on_any_dp_rank] = chunk_buffers(self.model, stages[stage].names, shapes, sizes,
                                                                     self.bucket_size)
            self._state[key] = chunk_state(self.model, stages[stage].names, shapes, sizes, coordinate,
                                            self.bucket_size, self.optimizer_kwargs, self._chunk_buffers[on_any_dp_rank])
        if (key, zero_stage) not in self._terms:
            self._terms[key, zero_stage] = state_terms(self._state[key], zero_stage)
        return self._terms[key, zero_stage]

    def _local_shapes(self, sizes: dict[str, int], coordinate: dict[str, int]) -> dict:
        key = (sizes["EP"], sizes["TP"], coordinate["EP"], coordinate["TP"])
        if key not in self._shapes:
            peers_key = (sizes["EP"], sizes["TP"], coordinate["EP"])
            if peers_key not in self._peers:
                self._peers[peers_key] = peer_shapes(self.model, self._plan(sizes), sizes, coordinate,
                                                      sorted({0, sizes["TP"] - 1}))  # the ranks priced
            self._shapes[key] = local_shapes(self.model, self._plan(sizes), sizes, coordinate, self._peers[peers_key])
        return self._shapes[key]

    def _plan(self, sizes: dict[str, int]) -> dict | None:
        key = (sizes["EP"], sizes["TP"])
        if key not in self._plans:
            self._plans[key] = self.sharding(self.model, sizes)
        return self._plans[key]

    # ---- time ----------------------------------------------------------------------------------
    def step_seconds(self, args: JobConfig) -> float:
        """The estimated seconds of one step of ``args``' layout."""
        ahead = self._ahead.get(_layout_key(args))
        if ahead and ahead[1] is not None:
            return ahead[1]
        sizes, resolved, stages, parts = self._layout(args)
        host = host_seconds(resolved, self.machine)
        forward = [sum(n * p.forward for n, p in zip(_counts(s), parts)) + host[i] for i, s in enumerate(stages)]
        backward = [sum(n * p.backward for n, p in zip(_counts(s), parts)) + host[i] for i, s in enumerate(stages)]
        _, io = self._composed(stages, parts)
        neighbours_share_a_host = "PP" in self.machine.within_host(sizes)
        links = [self.machine.collective_seconds("send", x.output, 2, within_host=neighbours_share_a_host)
                 for x in io[:-1]]
        sync, optimizer = sync_and_optimizer(resolved, sizes, self.machine,
                                             lambda stage: self._stage_buffers(stages, stage, sizes), self.optimizer,
                                             args.parallel.zero_stage)
        tp_comm = max(sum(n * p.tp_comm for n, p in zip(_counts(s), parts)) for s in stages)
        return step_terms(resolved, sizes, self.machine, forward, backward, links, sync, optimizer, tp_comm).seconds

    def _stage_buffers(self, stages: list[_Stage], stage: int, sizes: dict[str, int]) -> tuple[list, int]:
        key = (_counts(stages[stage]), sizes["DP"] * sizes["CP"], sizes["EP"], sizes["TP"])  # data ranks: DP x CP
        if key not in self._buffers:
            shapes = {n: peers[0] for n, peers in self._local_shapes(sizes, {"EP": 0, "TP": 0}).items()}
            self._buffers[key] = stage_buffers(self.model, stages[stage].names, shapes, sizes, self.bucket_size)
        return self._buffers[key]

    # ---- the parts -----------------------------------------------------------------------------
    def _layout(self, args: JobConfig) -> tuple[dict[str, int], ResolvedPlan, list[_Stage], list[Part]]:
        sizes, resolved = self._resolved(args)
        # CP ranks split each row's tokens, not the rows
        rows = args.data.global_batch // (sizes["DP"] * sizes["EP"] * args.parallel.micro_batches)
        return (sizes, resolved, self._split(resolved.num_stages),
                self.parts(_shard(sizes), args.parallel.activation_checkpointing, rows))

    @staticmethod
    def _resolved(args: JobConfig) -> tuple[dict[str, int], ResolvedPlan]:
        sizes = resolve_spec(args.parallel.mesh, None, dims=DIMS)
        plan = PipelineParallelPlan(schedule_type=args.parallel.schedule, virtual_chunks=args.parallel.virtual_chunks,
                                    num_microbatches=args.parallel.micro_batches)
        return sizes, resolve_plan(plan, sizes["PP"])

    def _split(self, num_stages: int) -> list[_Stage]:
        """The parts and parameters of each stage when the model is cut into ``num_stages``."""
        if num_stages not in self._stages:
            index = {fqn: i for i, fqn in enumerate(self.layers)}
            stages = []
            for layers in assign_stages(self.model, num_stages, None):
                at = [index[fqn] for fqn in layers]
                blocks = sum(self.before <= i < len(self.layers) - self.after for i in at)
                names, seen = [], set()
                for fqn in layers:
                    for name, p in self.model.get_submodule(fqn).named_parameters():
                        if id(p) not in seen:
                            seen.add(id(p))
                            names.append(f"{fqn}.{name}")
                stages.append(_Stage(any(i < self.before for i in at), blocks,
                                     any(i >= len(self.layers) - self.after for i in at), names))
            self._stages[num_stages] = stages
        return self._stages[num_stages]

    def parts(self, shard: Shard, recompute: bool, rows: int) -> list[Part]:
        """The three parts for micro-batches of ``rows`` rows over ``shard`` = (CP, EP, TP) ranks, from
        their traces (once per shard): without recompute at one and two rows, extended along the rows
        (all they hold and do is affine in them, balanced routing included; their seconds need not be,
        a GPU's being the slower of its host and its kernels); with recompute, the block as
        :meth:`_recomputed` makes it."""
        key = (shard, recompute, rows)
        if key not in self._parts:
            if shard not in self._traced:
                self._traced[shard] = self._trace_parts(shard, ((False, 1), (False, 2)))
            traced = [_affine(a, b, rows) for a, b in zip(*self._traced[shard])]
            if recompute:
                traced[1] = self._recomputed(traced[1], shard)
            self._parts[key] = self._priced(traced, shard)
        return self._parts[key]

    def price_ahead(self, layouts: list[JobConfig], budget: int) -> None:
        """Price ``layouts`` now, in parallel: their peaks, and the steps of those that fit ``budget``
        bytes (``peak_bytes`` and ``step_seconds`` then answer from what was priced). Two rounds, each
        split between this process and forked copies of it, one per spare core: the traces of each
        (CP, EP, TP) size (independent of each other, and most of a plan: 4.5 of 6.6 s for Llama-3 70B at
        512 ranks on 2 cores), then, every trace in hand, the layouts grouped by those sizes (each
        group's model-state terms are its own). A ZeRO-1 layout that does not fit and has more than one
        data rank is priced at ZeRO-2 too, beside it (``plan_layout`` asks for it next; its chunks'
        state is at hand there). Layouts priced already are skipped. Where ``fork`` is missing, or a
        copy fails, what is left is done on demand, as without this."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        layouts = [layout for layout in layouts if _layout_key(layout) not in self._ahead]
        if cores < 2 or "fork" not in multiprocessing.get_all_start_methods() or not layouts:
            return
        by_shard: dict[Shard, list[JobConfig]] = {}
        for layout in layouts:
            by_shard.setdefault(_shard(resolve_spec(layout.parallel.mesh, None, dims=DIMS)), []).append(layout)
        recompute = any(layout.parallel.activation_checkpointing for layout in layouts)
        # checkpointing is traced without TP or EP, over the smallest TP above one, and over each EP
        # size, per CP size (see _recomputed); a trace over TP or EP costs about three without (their
        # dispatch: 0.4 s against 0.13 s a trace for Llama-3 70B)
        shards = sorted(set(by_shard) - set(self._traced))
        with_recompute = {s: recompute and _recompute_at(s, shards) == s for s in shards}
        # done once here, not in each copy: the cuts, and loading torch's memory tracker (a first trace does)
        for cp in sorted({s[0] for s in shards}):
            for setting in [(False, 1), (False, 2)] + [(True, 1)] * recompute:
                self._cut(*setting, cp)
        torch_compat.TensorMemory  # noqa: B018
        # this process also prepares what pricing any layout needs (the stages of each PP size, each
        # rank's shapes, the schedules' action lists): done once before the pricing is forked, not in
        # every copy (0.35 s for Llama-3 70B, about three traces without TP)
        shares = _balanced([((s, with_recompute[s]), (1 + 2 * (s != (1, 1, 1))) * (2 + with_recompute[s]))
                            for s in shards], cores, first_load=3)
        for traced, recomputed in _in_parallel(self._trace_share, shares, first=lambda: self._prepare(layouts)):
            self._traced.update(traced)
            self._recompute.update(recomputed)
        shares = _balanced([(group, len(group)) for group in by_shard.values()], cores)
        for priced in _in_parallel(lambda share: self._price_share(share, budget), shares):
            self._ahead.update(priced)

    def _prepare(self, layouts: list[JobConfig]) -> None:
        """What pricing ``layouts`` needs besides the traces, cached (see :meth:`price_ahead`)."""
        for layout in layouts:
            sizes, resolved = self._resolved(layout)
            self._tied(self._split(resolved.num_stages), resolved)
            for coordinate in _representatives({**sizes, "PP": 1}):
                self._local_shapes(sizes, coordinate)
            if issubclass(resolved.schedule, PipelineScheduleMulti):
                rank_actions(resolved, 0)  # every PP rank's

    def _trace_share(self, share: list[tuple[Shard, bool]]) -> tuple[dict, dict]:
        for shard, with_recompute in share:
            if shard not in self._traced:
                self._traced[shard] = self._trace_parts(shard, ((False, 1), (False, 2)))
            if with_recompute and shard not in self._recompute:
                self._recompute[shard] = self._trace_parts(shard, ((True, 1),))[0][1]
        return ({shard: self._traced[shard] for shard, _ in share},
                {shard: self._recompute[shard] for shard, with_recompute in share if with_recompute})

    def _price_share(self, share: list[list[JobConfig]], budget: int) -> dict:
        priced = {}
        for layout in (layout for group in share for layout in group):
            ranks = self.rank_memory(layout)
            peak = max(r.peak for r in ranks)
            priced[_layout_key(layout)] = (peak, self.step_seconds(layout) if peak <= budget else None)
            sizes = resolve_spec(layout.parallel.mesh, None, dims=DIMS)
            data_ranks = sizes["DP"] * sizes["CP"] * sizes["EP"]
            if peak > budget and layout.parallel.zero_stage == 1 and data_ranks > 1:
                zero2 = layout.replace(zero_stage=2)
                # ZeRO-2 keeps at least 1/(DP x CP x EP) of each rank's grads and drops at most its grad sync's
                # extra (the .grad copies): where even that floor does not fit, it is the answer, unpriced
                floor = max(r.peak - r.by_name()["gradients"] * (1 - 1 / data_ranks) - r.by_name()["grad sync"]
                            for r in ranks)
                peak = self.peak_bytes(zero2) if floor <= budget else int(floor)
                priced[_layout_key(zero2)] = (peak, self.step_seconds(zero2) if peak <= budget else None)
        return priced

    def _recomputed(self, block: _Traced, shard: Shard) -> _Traced:
        """``block`` (at the rows priced, over ``shard`` = (CP, EP, TP) ranks) under activation
        checkpointing: it keeps only its inputs from forward to backward, and its backward runs its
        forward again first (its saved tensors back, the backward's temporaries on top: the same
        peak). Only as much of the forward runs again as yields what its backward needs (torch's
        checkpoint stops early): traced at one row without TP, over the first TP size above one asked
        for, and over each EP size, each at its own CP size (:func:`_recompute_at`); at any rows and TP
        size, the same ops again, the same share of the forward's FLOPs and bytes, and its collectives
        as far as the recompute went (:func:`_share_of`; the backward's seconds within 1e-5 of a trace
        at every TP size for Llama-3 70B and a tiny nanogpt and Llama; at cp = 2 for a nanogpt of two
        heads a TP rank, 0.3% over at one head a rank, where attention across CP runs an op fewer)."""
        at = _recompute_at(shard, self._recompute)
        if at not in self._recompute:
            if at not in self._traced:
                self._traced[at] = self._trace_parts(at, ((False, 1), (False, 2)))
            self._recompute[at] = self._trace_parts(at, ((True, 1),))[0][1]
        extra = _share_of(block.forward, self._traced[at][0][1], self._recompute[at])
        return _Traced(StageActivations(block.io.received, block.activations.peak_bytes), block.io, block.forward,
                       block.backward + extra)

    def _priced(self, parts: list[_Traced], shard: Shard) -> list[Part]:
        within = dict(zip(("CP", "EP", "TP"), shard))  # the mesh's innermost dims, in its order
        dtype, groups = DTYPES[self.args.model.dtype], sharding_groups(within)
        inside = groups.keys() & self.machine.within_host(within)
        return [Part(p.activations, p.io, work_seconds(p.forward, self.machine, dtype, groups, inside),
                     work_seconds(p.backward, self.machine, dtype, groups, inside),
                     self.machine.communication_seconds(p.forward + p.backward, groups, inside)) for p in parts]

    def _trace_parts(self, shard: Shard, settings: tuple[tuple[bool, int], ...]) -> list[list[_Traced]]:
        """The parts under each of ``settings`` (recompute, rows), over one fake world of ``shard`` =
        (CP, EP, TP) ranks (one mesh: DTensor's sharding decisions cached across the traces; with
        ``cp > 1`` a CP rank's tokens, attention across CP, its collectives named ``"CP"``). The proxy
        is cut once per setting and CP size, before TP is applied: the same cut for every TP size."""
        cp, ep, tp = shard
        sizes = {"PP": 3, "DP": 1, "CP": cp, "EP": ep, "TP": tp}
        group = next(iter(sharding_groups(sizes)))
        out = []
        with traced_world(sizes) as (mesh, context):
            names = {context.mesh.get_group().group_name: "CP"} if context is not None else {}
            for recompute, rows in settings:
                model = self._proxy(recompute)
                counter, regions = WorkCounter(), iter(range(3))

                def region(chunk: nn.Module) -> nn.Module:
                    counter.region(next(regions))
                    return chunk

                with counter:  # applying TP and handing a stage its inputs are no part's work
                    traced, io = trace(model, self._parts_plan, self._example(rows, cp), self.sharding(model, sizes),
                                        sizes, self.loss_fn, self.args.parallel.device, mesh=mesh, context=context,
                                        wrap=region, setup=lambda: counter.region("setup"),
                                        cut=self._cut(recompute, rows, cp))
                out.append([_Traced(traced[s], io[s], named_group(counter.work[s].forward, group, names),
                                    named_group(counter.work[s].backward, group, names)) for s in range(3)])
        return out

    def _example(self, rows: int, cp: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """A micro-batch of ``rows`` rows as a CP rank of ``cp`` takes it: its ``block_size / cp``
        tokens of each row, with their (global) positions where ``cp > 1`` (``data.example_batch``'s)."""
        ids = torch.zeros((rows, self.args.model.block_size // cp), dtype=torch.long, device="meta")
        return {"input_ids": ids, "position_ids": ids.clone()} if cp > 1 else ids

    def _cut(self, recompute: bool, rows: int, cp: int) -> ModelCut:
        """The proxy cut into its three parts for micro-batches of ``rows`` rows of a CP rank's tokens:
        once per setting and CP size, before TP is applied (the same cut for every TP size, and any
        copy of the proxy)."""
        if (recompute, rows, cp) not in self._cuts:
            self._cuts[recompute, rows, cp] = cut_model(self._proxy(recompute), self._parts_plan,
                                                        resolve_plan(self._parts_plan, 3), self._example(rows, cp),
                                                        "meta")
        return self._cuts[recompute, rows, cp]

    def _proxy(self, recompute: bool) -> nn.Module:
        """A fresh copy of the one-block model (built once per recompute setting: a copy of a meta
        model is far cheaper than building one, transformers' models above all)."""
        if recompute not in self._proxies:
            self._proxies[recompute] = self.build_model(one_block(self.args, activation_checkpointing=recompute), "meta")
        return copy.deepcopy(self._proxies[recompute])

    def _composed(self, stages: list[_Stage], parts: list[Part]) -> tuple[list[StageActivations], list[StageBytes]]:
        """Each stage's activations and :class:`estimate.StageBytes` as the sum of its parts: saved bytes
        and held outputs add up; the peak is the saved bytes and the largest part's temporaries; what a
        stage receives is its first part's input, what it sends its last part's output."""
        traced, io = [], []
        last = len(stages) - 1
        for index, stage in enumerate(stages):
            members = [p for n, p in zip(_counts(stage), parts) for _ in range(min(n, 1))]
            counts = [n for n in _counts(stage) if n]
            saved = sum(n * p.activations.saved_bytes for n, p in zip(counts, members))
            temporary = max(p.activations.peak_bytes - p.activations.saved_bytes for p in members)
            traced.append(StageActivations(saved, saved + temporary))
            weight_ops = sum(n * p.io.weight_op_outputs for n, p in zip(counts, members)) if index > 0 else 0
            io.append(StageBytes(received=members[0].io.received if index > 0 else 0, output=members[-1].io.output,
                               weight_op_outputs=weight_ops, loss_saved=parts[2].io.loss_saved if index == last else 0))
        return traced, io


def _layout_key(args: JobConfig) -> tuple:
    """What tells one layout of a job from another (``auto_mesh.layout_flags``' flags)."""
    return (args.parallel.mesh, args.parallel.schedule, args.parallel.virtual_chunks, args.parallel.micro_batches, args.parallel.activation_checkpointing,
            args.parallel.zero_stage)


def _balanced(jobs: list[tuple[Any, float]], workers: int, first_load: float = 0.0) -> list[list[Any]]:
    """``jobs`` (job, cost) in at most ``workers`` shares of about equal cost: the largest first, each
    to the least loaded share; the first share starts at ``first_load`` (work of its own)."""
    shares: list[list[Any]] = [[] for _ in range(min(workers, len(jobs)))]
    loads = [float(first_load)] + [0.0] * (len(shares) - 1)
    for job, cost in sorted(jobs, key=lambda jc: -jc[1]):
        least = loads.index(min(loads))
        shares[least].append(job)
        loads[least] += cost
    return shares


def _in_parallel(fn: Callable[[Any], Any], shares: list[Any], first: Callable[[], None] | None = None) -> list[Any]:
    """``fn`` of each share: the first here (after ``first()``, if given), the others in forked copies
    of this process; a failed copy's result is left out (its work is then done on demand). A copy
    still at work long after this share is done (stuck on a lock another thread held when it forked)
    is killed."""
    children = [_fork(lambda share=share: fn(share)) for share in shares[1:]]
    start = time.monotonic()
    try:
        if first is not None:
            first()
        results = [fn(shares[0])] if shares else []
    finally:  # the copies are waited for even when this share raises
        deadline = time.monotonic() + max(60.0, 4 * (time.monotonic() - start))
        others = [child(deadline) for child in children]
    return results + [r for r in others if r is not None]


def _fork(fn: Callable[[], Any]) -> Callable[[float], Any]:
    """Run ``fn`` in a forked copy of this process; the returned callable waits for its result until
    a ``time.monotonic()`` deadline (``None`` if the copy failed or ran past it: the caller does the
    work itself)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: nothing of the parent's (atexit, buffered output) runs on its way out
        os.close(read)
        code = 1
        try:
            # one core each; and a CPU kernel's thread pool started before the fork (OpenMP's) hangs
            # the copy at its next parallel kernel (seen: an arange of 36,864 elements)
            torch.set_num_threads(1)
            with os.fdopen(write, "wb") as out:
                pickle.dump(fn(), out)
            code = 0
        except BaseException as error:  # noqa: BLE001 - said, and left to the parent to do
            print(f"proxy: a forked copy failed ({type(error).__name__}: {error}); its share is done on demand",
                  file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    os.close(write)

    def result(deadline: float) -> Any:
        chunks = []
        with os.fdopen(read, "rb", buffering=0) as source:
            # read before waiting: the copy blocks on a full pipe until it is read
            while select.select([source], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = source.read(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            else:
                os.kill(pid, signal.SIGKILL)
                print("proxy: a forked copy ran past its time and was stopped; its share is done on demand",
                      file=sys.stderr, flush=True)
        _, status = os.waitpid(pid, 0)
        return pickle.loads(b"".join(chunks)) if status == 0 and chunks else None

    return result


def _share_of(forward: Work, base: _Traced, recomputed: _Traced) -> Work:
    """What a block whose ``forward`` is given runs again in its backward under checkpointing, as the
    ``recomputed`` trace of the ``base`` block runs it (another TP size): the same ops (their count:
    a larger TP size's forward adds ops of its own after them), the same share of the forward's FLOPs
    and bytes, and the forward's collectives as far as the recompute went."""
    extra, done = recomputed.backward, base.backward

    def share(field: str) -> float:
        whole = getattr(base.forward, field)
        return (getattr(extra, field) - getattr(done, field)) / whole if whole else 0.0

    return Work(extra.ops - done.ops, extra.dtensor_ops - done.dtensor_ops, forward.flops * share("flops"),
                forward.bytes * share("bytes"), forward.collectives[:len(extra.collectives) - len(done.collectives)])


def _recompute_at(shard: Shard, traced: Iterable[Shard]) -> Shard:
    """Where a block's recompute is traced for ``shard`` (see ``Pricer._recomputed``), at its own CP
    size (attention across CP runs ops of its own): without TP or EP for itself; over TP at the first
    TP size among ``traced`` (itself if none); over EP at its own size (the token dispatch's moves are
    no share of a TP trace's)."""
    cp, ep, tp = shard
    if tp == 1 or ep > 1:
        return shard
    return next((s for s in traced if s[0] == cp and s[1] == 1 and s[2] > 1), shard)


def one_block(args: JobConfig, **changes) -> JobConfig:
    """A copy of the job's ``args`` whose model has one block (the proxy whose parts are traced)."""
    if args.model.hf_config is None:
        return args.replace(n_layer=1, **changes)
    hf_config = copy.deepcopy(args.model.hf_config)
    hf_config.num_hidden_layers = 1
    if isinstance(getattr(hf_config, "layer_types", None), list):  # per-layer attention kinds
        hf_config.layer_types = hf_config.layer_types[:1]
    return args.replace(hf_config=hf_config, **changes)


def _ends(model: nn.Module, layers: list[str]) -> tuple[int, int]:
    """How many of the pipeline's ``layers`` of ``model`` run before its blocks and after them; the
    blocks are the entries of the container holding the most layers (a ``ModuleList``)."""
    ids = {id(model.get_submodule(fqn)): i for i, fqn in enumerate(layers)}
    containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    blocks = max(([ids[id(b)] for b in c if id(b) in ids] for c in containers), key=len, default=[])
    if not blocks:
        raise ValueError(f"{type(model).__name__} keeps no layers in a container: no blocks to price one of")
    return min(blocks), len(layers) - 1 - max(blocks)


def _counts(stage: _Stage) -> tuple[int, int, int]:
    return int(stage.before), stage.blocks, int(stage.after)


def _shard(sizes: dict[str, int]) -> Shard:
    return sizes["CP"], sizes["EP"], sizes["TP"]


def _representatives(sizes: dict[str, int]) -> list[dict[str, int]]:
    """One coordinate per PP rank and end of each of the other dims."""
    out = [{}]
    for d in DIMS:
        ends = range(sizes[d]) if d == "PP" else sorted({0, sizes[d] - 1})
        out = [{**c, d: i} for c in out for i in ends]
    return out


def _affine(one, two, rows: int):
    """A dataclass of numbers (nested; a list of tuples of them, the collectives) at ``rows`` rows,
    from its values at one and two rows."""
    if isinstance(one, list):
        if len(one) != len(two):
            raise ValueError(f"the parts ran {len(one)} collectives at one row and {len(two)} at two: not affine")
        return [tuple(x + (rows - 1) * (y - x) if isinstance(x, (int, float)) else x for x, y in zip(a, b))
                for a, b in zip(one, two)]
    if not dataclasses.is_dataclass(one):
        return one + (rows - 1) * (two - one)
    return type(one)(**{f.name: _affine(getattr(one, f.name), getattr(two, f.name), rows)
                        for f in dataclasses.fields(one)})
