"""``ndweave.plan.layouts``: every valid layout is enumerated and every other one cut with its reason;
the plan is the fastest layout that fits, by the caller's estimate; a 70B-sized search over 512 ranks
is quick."""

import math
import time
from dataclasses import replace

import pytest

from ndweave.mesh import resolve_spec
from ndweave.plan.layouts import Layout, ModelShape, enumerate_layouts, plan_layout

SHAPE = ModelShape(num_layers=4, num_heads=4)


def test_every_valid_layout_of_8_ranks_and_the_reasons_for_the_rest():
    valid, cut = enumerate_layouts(8, SHAPE, 16)
    assert valid and all(v.world_size == 8 for v in valid)
    assert {v.tp for v in valid} == {1, 2, 4}  # 4 heads: tp=8 cut
    assert all(v.pp * v.virtual_chunks <= 4 and v.micro_batches >= v.pp for v in valid if v.pp > 1)
    assert all((16 // (v.dp * v.ep)) % v.micro_batches == 0 for v in valid)
    assert all(v.schedule == "1f1b" and v.virtual_chunks == 1 for v in valid if v.pp == 1)
    reasons = {why.split(":")[0] for _, why in cut}
    assert {"tp does not divide the heads", "more stages than layers",
            "fewer micro-batches than stages' ranks"} <= reasons
    # each spec is one the mesh takes as is
    assert all(resolve_spec(v.spec(), 8) == {"PP": v.pp, "DP": v.dp, "TP": v.tp} for v in valid)


def test_experts_and_grouped_query_heads_and_the_callers_rules():
    valid, _ = enumerate_layouts(8, ModelShape(num_layers=8, num_heads=8, num_kv_heads=2, num_experts=4), 16,
                                 check=lambda layout: "no TP with experts" if layout.tp > 1 and layout.ep > 1 else None)
    assert {v.tp for v in valid} == {1, 2} and {v.ep for v in valid} == {1, 2, 4}
    assert not any(v.tp > 1 and v.ep > 1 for v in valid)
    assert {v.ep for v in enumerate_layouts(8, SHAPE, 16)[0]} == {1}  # dense: no EP


def test_context_parallel_is_tried_where_it_splits_the_sequence():
    """With the sequence length, CP takes ranks from DP where ``2 x cp`` divides it; the rows a data rank
    gets are DP x EP's (CP ranks share them); its spec names cp; without the length no CP is tried."""
    valid, cut = enumerate_layouts(8, ModelShape(num_layers=4, num_heads=4, seq_len=12), 16)
    assert {v.cp for v in valid} == {1, 2}  # 12 tokens: 2 x cp=4 does not divide them
    assert any(why.startswith("cp does not split the sequence") for _, why in cut)
    assert all(v.world_size == 8 and (16 // (v.dp * v.ep)) % v.micro_batches == 0 for v in valid)
    two = next(v for v in valid if v.cp == 2 and v.pp == 1 and v.tp == 1)
    assert two.spec() == "pp=1,dp=4,cp=2,tp=1"
    assert resolve_spec(two.spec(), 8, dims=("PP", "DP", "CP", "TP")) == {"PP": 1, "DP": 4, "CP": 2, "TP": 1}
    # memory tight enough that only splitting the sequence fits: CP is chosen over a pipeline or TP
    def estimate(layout: Layout) -> tuple[int, float]:
        return 1000 // (layout.cp * layout.pp * layout.tp), 1.0 + 0.1 * (layout.pp + layout.tp) + 0.02 * layout.cp
    planned = plan_layout(8, 300, 16, ModelShape(num_layers=4, num_heads=4, seq_len=64), estimate=estimate)
    assert planned.best.cp == 4 and planned.best.dp == 2, planned.table()


def _estimate(layout: Layout) -> tuple[int, float]:
    """A toy cost: memory divided by the model dims and grown by held micro-batches; time: compute over
    the world, a pipeline bubble, and a TP collective cost."""
    held = layout.micro_batches if layout.schedule == "gpipe" else min(layout.micro_batches, layout.pp)
    memory = 1000 // (layout.pp * layout.tp) + (10 if layout.recompute else 100) * held // layout.micro_batches
    bubble = (layout.pp - 1) / (layout.virtual_chunks * layout.micro_batches + layout.pp - 1)
    return memory, (1 + bubble) * (1.3 if layout.recompute else 1.0) / 8 + 0.01 * (layout.tp - 1)


def test_the_fastest_layout_that_fits_is_chosen_and_the_others_are_said_cut():
    everything = plan_layout(8, 10**9, 16, SHAPE, estimate=_estimate)
    assert everything.best == Layout(pp=1, dp=8, tp=1, micro_batches=1)  # it fits: no bubble, no collective
    tight = plan_layout(8, 300, 16, SHAPE, estimate=_estimate)
    assert tight.best is not None and _estimate(tight.best)[0] <= 300 and tight.best.pp * tight.best.tp >= 4
    assert [c.step_seconds for c in tight.ranked] == sorted(c.step_seconds for c in tight.ranked)
    assert any(why.startswith("does not fit") for _, why in tight.cut)
    text = tight.table()
    assert "<- chosen" in text and "cut" in text and "does not fit" in text
    none = plan_layout(8, 10, 16, SHAPE, estimate=_estimate)
    assert none.best is None and not none.ranked


def test_zero2_is_tried_where_zero1_does_not_fit():
    # a toy cost: ZeRO-2 halves the memory over the data ranks and costs more time (a reduction per micro-batch)
    def estimate(layout: Layout) -> tuple[int, float]:
        memory, seconds = _estimate(layout)
        return (memory // 2, seconds * 1.1) if layout.zero_stage == 2 else (memory, seconds)

    roomy = plan_layout(8, 10**9, 16, SHAPE, estimate=estimate)
    assert all(c.layout.zero_stage == 1 for c in roomy.ranked)  # it saves memory, never time
    prepared: list[list[Layout]] = []
    tight = plan_layout(8, 300, 16, SHAPE, estimate=estimate, prepare=prepared.append)
    # the estimator sees the ZeRO-2 layouts before they are estimated, as it saw the others
    assert [{layout.zero_stage for layout in batch} for batch in prepared] == [{1}, {2}]
    assert all(_estimate(replace(layout, zero_stage=1))[0] > 300 for layout in prepared[1])
    zero2 = [c for c in tight.ranked if c.layout.zero_stage == 2]
    assert zero2 and all(c.layout.dp * c.layout.ep > 1 and _estimate(c.layout)[0] > 300 for c in zero2)
    assert "zero2" in zero2[0].layout.describe()
    assert all(layout.zero_stage == 2 or layout.dp * layout.ep == 1 for layout, why in tight.cut
               if why.startswith("does not fit"))


def test_a_70b_search_over_512_ranks_takes_seconds():
    shape = ModelShape(num_layers=80, num_heads=64, num_kv_heads=8)
    start = time.perf_counter()
    planned = plan_layout(512, 80 * 2**30, 1024, shape, max_tp=8, estimate=_analytic_70b)
    assert time.perf_counter() - start < 5
    best = planned.best
    assert best is not None and best.tp <= 8 and best.world_size == 512
    assert len(planned.ranked) + len(planned.cut) > 1000


def _analytic_70b(layout: Layout) -> tuple[int, float]:
    """Megatron's counts for a 70B dense model in bf16 with fp32 Adam (16 bytes per parameter, the
    12 of optimizer state and masters sharded over DP) and 34·s·h·b bytes of activations per layer."""
    params, h, s, layers = 70e9, 8192, 4096, 80
    local = params / (layout.pp * layout.tp)
    state = local * (4 + 12 / layout.dp)
    rows = 1024 // (layout.dp * layout.micro_batches)
    per_layer = (2 if layout.recompute else 34) * s * h * rows / layout.tp
    held = layout.micro_batches if layout.schedule == "gpipe" else min(layout.micro_batches, layout.pp)
    memory = state + per_layer * layers / layout.pp * held
    bubble = (layout.pp - 1) / (layout.virtual_chunks * layout.micro_batches + layout.pp - 1)
    return int(memory), 6 * params * 1024 * s / (512 * 4e14) * (1 + bubble) * (4 / 3 if layout.recompute else 1)


def test_the_table_lists_at_most_top_rows():
    planned = plan_layout(8, 10**9, 16, SHAPE, estimate=_estimate)
    assert len([line for line in planned.table(top=3).splitlines() if "recompute" in line or "m=" in line]) >= 3
    assert math.isfinite(planned.ranked[0].step_seconds)


@pytest.mark.parametrize("world", [1, 6])
def test_small_and_odd_worlds(world):
    valid, _ = enumerate_layouts(world, ModelShape(num_layers=3, num_heads=6), 12)
    assert valid and all(v.world_size == world for v in valid)
