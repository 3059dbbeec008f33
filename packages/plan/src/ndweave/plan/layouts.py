"""Which layout to launch: every valid way to lay a model over ``world_size`` ranks (PP x DP x CP x
EP x TP, the pipeline schedule and its virtual chunks, micro-batches, recompute, the ZeRO stage), cut by a
memory estimate, ranked by a step-time estimate, with a table of the best and why the others were cut.

The search knows only the model's shape (layers, heads, experts, sequence length) and the batch; what a layout costs
comes from the caller, who adds up the packages' own layout models (a job does; see
``ndweave_gpt.cost.estimate`` in ``examples/gpt``), the way a data-parallel wrapper is passed to the optimizer: plan
imports no other package. It returns a spec ``init_mesh_from_spec`` takes as is::

    planned = plan_layout(8, memory_per_device=2**30, global_batch=16,
                          shape=ModelShape(num_layers=4, num_heads=4), estimate=my_estimate)
    planned.best.spec()   # "pp=2,dp=2,tp=2"
    print(planned.table())
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

__all__ = ["Candidate", "Layout", "ModelShape", "Planned", "enumerate_layouts", "plan_layout"]

#: The schedules tried by default and the virtual chunks (stages per PP rank) each runs with.
SCHEDULES: dict[str, tuple[int, ...]] = {"1f1b": (1,), "gpipe": (1,), "interleaved_1f1b": (2,), "zero_bubble": (2,)}


@dataclass(frozen=True, order=True)
class Layout:
    """One way to run the job: the mesh and what runs on it."""

    pp: int
    """Pipeline stages' ranks (the PP dim's size)."""
    dp: int
    """Data-parallel ranks (the optimizer's state is sharded over them; with ZeRO-2 the grads too)."""
    tp: int
    """Tensor (+sequence) parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks (they also split the batch, like DP)."""
    cp: int = 1
    """Context-parallel ranks: each holds ``1 / cp`` of every sequence (attention across them); data
    ranks for the parameters' grads and the optimizer's state, not for the batch's rows."""
    schedule: str = "1f1b"
    """The pipeline schedule (with ``pp == 1``: micro-batches are gradient accumulation)."""
    virtual_chunks: int = 1
    """Stages per PP rank (interleaved schedules: 2)."""
    micro_batches: int = 1
    """Micro-batches per data rank's batch."""
    recompute: bool = False
    """Activation checkpointing per layer."""
    zero_stage: int = 1
    """What the data ranks split: 1, the optimizer's state (ZeRO-1); 2, the grads too (ZeRO-2)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.ep * self.tp

    def spec(self) -> str:
        """The mesh as ``--mesh`` / ``init_mesh_from_spec`` take it, e.g. ``"pp=2,dp=2,tp=2"`` (cp and ep
        when > 1)."""
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep, "tp": self.tp}
        return ",".join(f"{k}={v}" for k, v in sizes.items() if k not in ("cp", "ep") or v > 1)

    def describe(self) -> str:
        """The spec and the rest, in one line."""
        chunks = f" v={self.virtual_chunks}" if self.virtual_chunks > 1 else ""
        extras = " ".join(["recompute"] * self.recompute + [f"zero{self.zero_stage}"] * (self.zero_stage != 1))
        return f"{self.spec():<22} {self.schedule + chunks:<20} m={self.micro_batches:<3} {extras:<15}"


@dataclass(frozen=True)
class ModelShape:
    """What the search needs to know of the model to tell a valid layout."""

    num_layers: int
    """Transformer blocks (every stage holds at least one)."""
    num_heads: int
    """Attention heads (tensor parallel divides them)."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention; tensor parallel divides them too). None: num_heads."""
    num_experts: int = 0
    """Experts per MoE layer (0: dense); expert parallel divides them."""
    seq_len: int | None = None
    """Tokens per sequence: context parallel cuts each into ``2 x cp`` chunks (a head and a tail per
    rank). None: no layout with ``cp > 1`` is tried."""


@dataclass(frozen=True)
class Candidate:
    """A valid layout and its estimate."""

    layout: Layout
    peak_bytes: int
    """The estimated peak memory of its busiest rank."""
    step_seconds: float
    """The estimated time of one optimizer step."""


@dataclass
class Planned:
    """What :func:`plan_layout` chose, and why."""

    best: Layout | None
    """The fastest layout that fits (None: none fits; see ``cut``)."""
    ranked: list[Candidate]
    """Every layout that fits, fastest first."""
    cut: list[tuple[Layout, str]] = field(default_factory=list)
    """Every layout left out, with the reason (it does not divide the model or batch, or does not fit)."""
    memory_per_device: int = 0

    def table(self, top: int = 8) -> str:
        """The ``top`` fastest layouts that fit, then how many were cut for each reason (an example each)."""
        lines = [f"{'layout':<22} {'schedule':<20} {'m':<5} {'':<15} {'peak GiB':>9} {'step s':>9}"]
        for c in self.ranked[:top]:
            mark = "  <- chosen" if c.layout == self.best else ""
            lines.append(f"{c.layout.describe()} {c.peak_bytes / 2**30:>9.3f} {c.step_seconds:>9.4f}{mark}")
        if len(self.ranked) > top:
            lines.append(f"... {len(self.ranked) - top} more that fit")
        reasons: dict[str, list[Layout]] = {}
        for layout, reason in self.cut:
            reasons.setdefault(reason.split(":")[0], []).append(layout)
        for reason, layouts in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"cut {len(layouts):>5}: {reason} (e.g. {layouts[0].spec()} {layouts[0].schedule} "
                         f"m={layouts[0].micro_batches})")
        return "\n".join(lines)


def enumerate_layouts(world_size: int, shape: ModelShape, global_batch: int, *,
                      schedules: dict[str, Sequence[int]] | None = None, max_tp: int | None = None,
                      max_cp: int = 8,
                      recompute: Iterable[bool] = (False, True), micro_batches: Iterable[int] | None = None,
                      check: Callable[[Layout], str | None] | None = None) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """Every layout of ``world_size`` ranks (valid ones, and the others with the reason each is not).

    Valid: the dims multiply to the world; TP divides the heads (and KV heads); EP divides the experts
    (and is 1 for a dense model); ``2 x cp`` divides the sequence (``cp`` is 1 without
    ``shape.seq_len``; at most ``max_cp``, since every CP size is one more the caller's estimate
    traces, and CP's exchanges per layer grow with it);
    every stage gets a layer (``pp * virtual_chunks <= num_layers``);
    the data ranks (DP x EP) times the micro-batches divide the global batch; a pipeline gets at least
    ``pp`` micro-batches (fewer leave ranks idle by construction); and ``check(layout)``, the caller's
    own rules (a job's, a schedule's), returns no reason. ``schedules``: name -> virtual chunks to try
    (default :data:`SCHEDULES`; with ``pp == 1`` only ``"1f1b"``). ``micro_batches``: the counts to
    try (default: every divisor of the per-data-rank batch)."""
    schedules = SCHEDULES if schedules is None else schedules
    recompute = tuple(recompute)
    valid: list[Layout] = []
    cut: list[tuple[Layout, str]] = []
    kv = shape.num_kv_heads or shape.num_heads
    for pp in _divisors(world_size):
        for tp in _divisors(world_size // pp):
            for ep in _divisors(world_size // (pp * tp)) if shape.num_experts else (1,):
                sizes = [c for c in _divisors(world_size // (pp * tp * ep)) if c <= max_cp] if shape.seq_len else [1]
                for cp in sizes:
                    dp = world_size // (pp * tp * ep * cp)
                    base = Layout(pp=pp, dp=dp, tp=tp, ep=ep, cp=cp)
                    reason = _mesh_reason(base, shape, kv, global_batch, max_tp)
                    if reason:
                        cut.append((base, reason))
                        continue
                    rows = global_batch // (dp * ep)  # (CP ranks split the rows' tokens, not the rows)
                    counts = sorted(set(micro_batches)) if micro_batches is not None else _divisors(rows)
                    for name, chunks in (schedules.items() if pp > 1 else [("1f1b", (1,))]):
                        for v in chunks:
                            for m in counts:
                                for r in recompute:
                                    layout = replace(base, schedule=name, virtual_chunks=v, micro_batches=m,
                                                     recompute=r)
                                    why = _run_reason(layout, shape, rows) or (check(layout) if check else None)
                                    (cut.append((layout, why)) if why else valid.append(layout))
    return valid, cut


def plan_layout(world_size: int, memory_per_device: int, global_batch: int, shape: ModelShape, *,
                estimate: Callable[[Layout], tuple[int, float]],
                prepare: Callable[[list[Layout]], None] | None = None, **search) -> Planned:
    """The fastest layout whose estimated peak fits ``memory_per_device`` bytes on every rank.

    ``estimate(layout) -> (peak bytes of the busiest rank, step seconds)``; ``prepare(layouts)``, if
    given, sees every valid layout once before any is estimated (an estimator that can do shared
    work ahead, or in parallel, does it there); ``search``: the keywords of :func:`enumerate_layouts`.
    A layout is estimated with ZeRO-1, and where that does not fit and it has more than one data
    rank (DP x CP x EP), again with ZeRO-2 (which saves memory, never time: each micro-batch reduces
    its grads). Ties go to the smaller pipeline, then the smaller TP (fewer collectives per layer),
    then the smaller CP, then fewer micro-batches."""
    layouts, cut = enumerate_layouts(world_size, shape, global_batch, **search)
    if prepare is not None:
        prepare(layouts)
    estimates = [(layout, *estimate(layout)) for layout in layouts]
    zero2 = [replace(layout, zero_stage=2) for layout, peak, _ in estimates
             if peak > memory_per_device and layout.dp * layout.cp * layout.ep > 1]
    if prepare is not None and zero2:
        prepare(zero2)
    zero2_estimates = {layout: estimate(layout) for layout in zero2}
    ranked = []
    for layout, peak, seconds in estimates:
        if replace(layout, zero_stage=2) in zero2_estimates:
            layout = replace(layout, zero_stage=2)
            peak, seconds = zero2_estimates[layout]
        if peak > memory_per_device:
            cut.append((layout, f"does not fit: peak {peak / 2**30:.3f} GiB > {memory_per_device / 2**30:.3f} GiB"))
        else:
            ranked.append(Candidate(layout, peak, seconds))
    ranked.sort(key=lambda c: (c.step_seconds, c.layout.pp, c.layout.tp, c.layout.cp, c.layout.micro_batches,
                               c.layout.recompute, c.layout.zero_stage))
    return Planned(ranked[0].layout if ranked else None, ranked, cut, memory_per_device)


def _mesh_reason(layout: Layout, shape: ModelShape, kv: int, global_batch: int, max_tp: int | None) -> str | None:
    if shape.num_heads % layout.tp or kv % layout.tp:
        return f"tp does not divide the heads: {shape.num_heads} heads ({kv} key/value) over tp={layout.tp}"
    if max_tp is not None and layout.tp > max_tp:
        return f"tp above max_tp: tp={layout.tp} > {max_tp} (tensor parallel stays inside a node)"
    if shape.num_experts and shape.num_experts % layout.ep:
        return f"ep does not divide the experts: {shape.num_experts} experts over ep={layout.ep}"
    if shape.seq_len and shape.seq_len % (2 * layout.cp):
        return f"cp does not split the sequence: {shape.seq_len} tokens into 2 x cp={2 * layout.cp} chunks"
    if global_batch % (layout.dp * layout.ep):
        return f"the data ranks do not divide the batch: {global_batch} samples over dp x ep={layout.dp * layout.ep}"
    return None


def _run_reason(layout: Layout, shape: ModelShape, rows: int) -> str | None:
    stages = layout.pp * layout.virtual_chunks
    if stages > shape.num_layers:
        return f"more stages than layers: {stages} stages for {shape.num_layers} layers"
    if rows % layout.micro_batches:
        return f"the micro-batches do not divide a data rank's batch: {rows} over m={layout.micro_batches}"
    if layout.pp > 1 and layout.micro_batches < layout.pp:
        return f"fewer micro-batches than stages' ranks: m={layout.micro_batches} < pp={layout.pp}"
    return None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
