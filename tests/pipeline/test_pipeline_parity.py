"""Every schedule trains like one process: losses, every grad of every step and the final parameters,
float64 strict on PP=4 and on PP=2 x DP=2 (the reference data-parallel wrapper), and fp32 within a
bound measured from reordered one-process runs on PP=2 and PP=4, with the tied embedding / head on
the first and last stage."""

from __future__ import annotations

import pytest

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import ReferenceDataParallel, distributed, run_distributed
from ndweave.pipeline import PipelineParallelPlan
from pipeline_models import assert_same_training, fp32_one_process_run, one_process_run, train_pipeline

STEPS = 10
# (schedule, virtual chunks, micro-batches): every schedule, zero bubble with one and two stages per rank
SCHEDULES = [
    ("gpipe", 1, 4),
    ("1f1b", 1, 4),
    ("interleaved_1f1b", 2, 4),
    ("zero_bubble", 1, 4),
    ("zero_bubble", 2, 4),
]


@pytest.mark.parity
@distributed(world_size=4, timeout=300)
def test_every_schedule_matches_one_process_on_pp4():
    model, data, expected = one_process_run(num_layers=6, steps=STEPS)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("PP",))
    for schedule, virtual, micro in [*SCHEDULES, ("gpipe", 1, 2)]:  # GPipe also with fewer micro-batches than stages
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=micro)
        assert_same_training(train_pipeline(model, plan, mesh, data), expected, f"PP=4 {schedule} v={virtual} m={micro}")


@pytest.mark.parity
@distributed(world_size=4, timeout=300)
def test_every_schedule_matches_one_process_on_pp2_dp2():
    model, data, expected = one_process_run(num_layers=4, steps=STEPS)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "DP"))
    for schedule, virtual, micro in SCHEDULES:
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=micro,
                                    activation_recompute=schedule == "1f1b")
        actual = train_pipeline(model, plan, mesh, data, data_parallel=mesh["DP"],
                                wrap=lambda chunk: ReferenceDataParallel(chunk, mesh["DP"]))
        assert_same_training(actual, expected, f"PP=2 x DP=2 {schedule} v={virtual}")


@pytest.mark.kernels
@pytest.mark.parity
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_one_process_in_fp32(pp):
    run_distributed(_every_schedule_in_fp32, pp, pp, timeout=300)


def _every_schedule_in_fp32(pp: int) -> None:
    # fp32 on both sides: the bound is what summing the same training in other orders (the pipeline's
    # micro-batches, and twice as many) does on this machine's kernels
    model, data, expected, tols = fp32_one_process_run(num_layers=2 * pp, steps=STEPS, num_microbatches=4)
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("PP",))
    for schedule, virtual, micro in SCHEDULES:
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=micro)
        assert_same_training(train_pipeline(model, plan, mesh, data), expected,
                             f"fp32 PP={pp} {schedule} v={virtual} m={micro}", tols)


@pytest.mark.parity
@distributed(world_size=2, timeout=300)
def test_torchs_other_schedules_match_one_process():
    # looped BFS and the V-shaped schedules (stages s and 2p-1-s on rank s: the tied embedding and
    # head are one tensor on rank 0, autograd sums its grads); with DP wrappers that is refused
    model, data, expected = one_process_run(num_layers=4, steps=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    for schedule in ("looped_bfs", "zbv_zero_bubble", "dualpipev"):
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=2, num_microbatches=4)
        assert_same_training(train_pipeline(model, plan, mesh, data), expected, f"PP=2 {schedule}")
    # the rank holding both copies refuses before any communication, and every rank raises its error
    with pytest.raises(NotImplementedError, match=r"PipeEngine failed on rank 0: .*two stages \[0, 3\] of this rank.*"
                                                  r"data-parallel wrappers"):
        train_pipeline(model, plan, mesh, data, wrap=ReferenceDataParallel)
