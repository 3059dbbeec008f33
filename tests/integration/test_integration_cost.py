"""Before anything is allocated: ddp's bucket planner and optim's state arithmetic, composed as an
estimator would (nothing but sizes), predict the bytes DDP + ``DistributedOptimizer`` allocate on
every rank, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from integration_models import build
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.ddp.buffer import plan_buckets
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import distributed
from ndweave.optim import DistributedOptimizer
from ndweave.optim.cost import state_bytes_per_rank

BUCKET = 20_000


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@distributed(world_size=2, timeout=120)
def test_planned_bytes_equal_the_allocated_ones_on_the_gpt(dtype):
    model = build("gpt", seed=0).to(dtype)
    # the estimate: sizes only (a meta model would do), in DDP's layout order
    named = [(n, p.numel(), p.numel()) for n, p in reversed(list(model.named_parameters())) if p.requires_grad]
    plan = plan_buckets(named, data_parallel_size=2, bucket_size=BUCKET)
    layout = [(b.end - b.start, [(offset, n) for _, offset, n in b.entries]) for b in plan]
    predicted = state_bytes_per_rank(layout, data_parallel_size=2, dp_rank=dist.get_rank(), param_dtype=dtype,
                                     optimizer=torch.optim.AdamW)
    grad_bytes = (plan[-1].end if plan else 0) * torch.promote_types(dtype, torch.float32).itemsize

    ddp = DDP(model, init_device_mesh("cpu", (2,), mesh_dim_names=("DP",)), bucket_size=BUCKET,
              use_distributed_optimizer=True, accumulate_allreduce_grads_in_fp32=True)
    opt = DistributedOptimizer(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-3})
    x = torch.randint(0, 64, (2, 8))
    ddp(x, x)[1].backward()
    opt.step()
    assert sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.grad_buckets()) == grad_bytes
    assert (predicted.state, predicted.masters) == (opt.optimizer_state_bytes(), opt.master_param_bytes())
