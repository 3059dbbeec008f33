"""The end of a job on a mesh with a bounded timeout: one rank calls ``optimizer.step()`` once more
after the loop while the others are already in their final call (``shutdown()``). Before, the extra
step's collectives waited for torch's 30 minutes (or paired up with another collective of the
others); now every rank raises within the mesh's timeout, naming the other side, whether DDP
finishes the grad sync in backward or the optimizer's step does."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndweave.ddp import DDP, GradSyncDivergedError
from ndweave.mesh import ShutdownError, init_device_mesh, shutdown
from ndweave.mesh.testing import distributed
from ndweave.optim import DistributedOptimizer

TIMEOUT_S = 3  # the mesh's collective timeout: the bound every rank's error must come within


@pytest.mark.parametrize("finish_in_backward", [True, False])
@distributed(world_size=2, init_process_group=False, timeout=120)
def test_an_extra_step_after_the_loop_is_named_on_every_rank(finish_in_backward):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("DP",), timeout=TIMEOUT_S)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = DDP(model, mesh["DP"], bucket_size=32, use_distributed_optimizer=True,
                finish_grad_sync_in_backward=finish_in_backward)
    optimizer = DistributedOptimizer(torch.optim.AdamW, [model], clip_grad=1.0, optimizer_kwargs={"lr": 0.01})
    for _ in range(3):
        optimizer.zero_grad()
        F.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
        optimizer.step()
    begin = time.monotonic()
    if dist.get_rank() == 1:
        with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) called step\(\) a 4th time, with 0 "
                                                        r"forward\(s\) and no backward since grad sync #3.*ranks \[0\] "
                                                        r"had already called shutdown\(\)"):
            try:
                optimizer.step()  # once more: rank 0 has left the loop
            except GradSyncDivergedError:
                shutdown(abort=True)
                raise
    else:
        with pytest.raises(ShutdownError, match=r"rank 1 failed: GradSyncDivergedError: rank 1 \(DP rank 1\) called "
                                                r"step\(\) a 4th time") as raised:
            shutdown(timeout=4 * TIMEOUT_S)
        assert list(raised.value.failed) == [1]
    assert time.monotonic() - begin < 3 * TIMEOUT_S
    assert not dist.is_initialized()
