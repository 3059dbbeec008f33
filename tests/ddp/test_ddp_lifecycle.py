"""A DP rank that leaves the training loop out of step with the others, on a mesh with a bounded
timeout: every rank raises within that bound, naming the other side, instead of waiting out torch's
30 minutes. The loop is the user's: train, then ``shutdown()``; ``shutdown(abort=True)`` in the
error handler."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
import torch.nn.functional as F

from ddp_cases import MLP, batch, rows
from ndweave.ddp import DDP, GradSyncDivergedError
from ndweave.mesh import ShutdownError, init_device_mesh, shutdown
from ndweave.mesh.testing import distributed

TIMEOUT_S = 3  # the mesh's collective timeout: the bound every rank's error must come within


def _micro_batch(step: int):
    x, y = batch(step)
    return rows(x, dist.get_rank(), 2), rows(y, dist.get_rank(), 2)


@distributed(world_size=2, init_process_group=False, timeout=120)
def test_no_sync_on_one_rank_that_then_leaves_the_loop_is_named_on_every_rank():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("DP",), timeout=TIMEOUT_S)
    model = DDP(MLP(), mesh["DP"], bucket_size=100)
    for step in range(2):
        x, y = _micro_batch(step)
        F.mse_loss(model(x), y).backward()
    x, y = _micro_batch(2)
    begin = time.monotonic()
    if dist.get_rank() == 1:  # its last backward only accumulates, and it leaves the loop
        with model.no_sync():
            F.mse_loss(model(x), y).backward()
        with pytest.raises(ShutdownError, match=r"rank 0 failed: GradSyncDivergedError: .*ranks \[1\] had already "
                                                r"called shutdown\(\)") as raised:
            shutdown(timeout=4 * TIMEOUT_S)
        assert list(raised.value.failed) == [0]
    else:  # its last backward syncs, and waits at the check for rank 1
        with pytest.raises(GradSyncDivergedError, match=r"rank 0 waited 0:00:03 at the DP ranks' check before a grad "
                                                        r"sync.*ranks \[1\] had already called shutdown\(\)"):
            try:
                F.mse_loss(model(x), y).backward()
            except GradSyncDivergedError:
                shutdown(abort=True)  # tells rank 1 why
                raise
    assert time.monotonic() - begin < 3 * TIMEOUT_S
    assert not dist.is_initialized()
