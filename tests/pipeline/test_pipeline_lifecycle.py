"""``PipeEngine.close()``: the engine's own process group over the PP ranks (tagged, with the mesh's
timeout) is destroyed and what the engine holds released; the mesh and the chunks stay usable."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import distributed
from ndweave.mesh.torch_compat import group_timeout, live_groups
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage
from pipeline_models import TinyLM, batches, loss_fn


@distributed(world_size=2, timeout=120)
def test_close_destroys_the_engines_group_and_a_new_engine_runs_on_the_same_mesh():
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=2)
    module = construct_pipeline_stage(TinyLM(num_layers=4), plan, mesh)
    (x, y), = batches(1, 4)
    with PipeEngine(module, mesh, loss_fn) as engine:
        group = engine._group
        assert group.group_desc == "ndweave:pipeline" and group is not mesh["PP"].get_group()
        assert group_timeout(group) == group_timeout(mesh["PP"].get_group()) == timedelta(seconds=180)  # the harness's
        loss = engine(x, y)
    assert group not in live_groups() and engine.stages is None and engine.schedule is None
    engine.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="this PipeEngine is closed"):
        engine(x, y)
    module.zero_grad()
    again = PipeEngine(module, mesh, loss_fn)  # its group over the same ranks: a fresh name, no stale keys
    assert torch.equal(again(x, y), loss)
    again.close()
    dist.barrier()
