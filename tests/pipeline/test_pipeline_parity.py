"""Every schedule trains like one process: losses, every grad of every step and the final parameters,
float64 strict, on PP=4 and on PP=2 x DP=2 (the reference data-parallel wrapper), with the tied
embedding / head on the first and last stage."""

from __future__ import annotations

import pytest
import torch

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import ReferenceDataParallel, distributed
from ndweave.pipeline import PipelineParallelPlan
from pipeline_models import TinyLM, assert_same_training, batches, train_pipeline, train_reference

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
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TinyLM(num_layers=6)
    data = batches(3, 8)
    expected = train_reference(model, data)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("PP",))
    for schedule, virtual, micro in [*SCHEDULES, ("gpipe", 1, 2)]:  # GPipe also with fewer micro-batches than stages
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=micro)
        assert_same_training(train_pipeline(model, plan, mesh, data), expected, f"PP=4 {schedule} v={virtual} m={micro}")


@pytest.mark.parity
@distributed(world_size=4, timeout=300)
def test_every_schedule_matches_one_process_on_pp2_dp2():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TinyLM(num_layers=4)
    data = batches(3, 8)
    expected = train_reference(model, data)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "DP"))
    for schedule, virtual, micro in SCHEDULES:
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=micro,
                                    activation_recompute=schedule == "1f1b")
        actual = train_pipeline(model, plan, mesh, data, data_parallel=mesh["DP"],
                                wrap=lambda chunk: ReferenceDataParallel(chunk, mesh["DP"]))
        assert_same_training(actual, expected, f"PP=2 x DP=2 {schedule} v={virtual}")
