"""A DP rank that leaves the training loop out of step with the others, on a mesh with a bounded
timeout: every rank raises within that bound, naming the other side, instead of waiting out torch's
30 minutes. The loop is the user's: train, then ``shutdown()``; ``shutdown(abort=True)`` in the
error handler."""

from __future__ import annotations

import time

import pytest
import torch
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
        with pytest.raises(GradSyncDivergedError, match=r"rank 0 \(DP rank 0\) finishes grad sync #3 .*did not come "
                                                        r"to the DP ranks' check.*ranks \[1\] had already called "
                                                        r"shutdown\(\)"):
            try:
                F.mse_loss(model(x), y).backward()
            except GradSyncDivergedError:
                shutdown(abort=True)  # tells rank 1 why
                raise
    assert time.monotonic() - begin < 3 * TIMEOUT_S
    assert not dist.is_initialized()


# ---------------------------------------------------------------------- close()
def _local_grads(model: MLP, x, y) -> list:
    """The grads one rank's batch gives the model alone (no DDP): what a backward after close() leaves."""
    for p in model.parameters():
        p.grad = None
    F.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@distributed(world_size=2)
def test_close_unhooks_the_model_and_a_backward_after_it_leaves_the_buckets_alone(zero_stage):
    group = dist.new_group([0, 1])
    with DDP(MLP(), group, bucket_size=100, zero_stage=zero_stage) as model:
        x, y = _micro_batch(0)
        F.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        buckets = model.grad_buckets()
        synced = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    # the with block closed it: the synced grads stay, as the parameters' own tensors
    assert model.grad_buckets() == () and model._hooks == []
    held = [b.grad_data.clone() for b in buckets]
    for p, grad in zip(model.parameters(), synced):
        assert (p.grad is None) if grad is None else torch.equal(p.grad, grad)
        if p.grad is not None:
            assert all(p.grad.untyped_storage().data_ptr() != b.grad_data.untyped_storage().data_ptr() for b in buckets)

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran after close()")

    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
    saved = {name: getattr(dist, name) for name in names}
    x, y = _micro_batch(1 + dist.get_rank())  # each rank its own batch, one rank a second backward
    expected = _local_grads(MLP(), x, y)
    try:  # (patched by hand: the rank runs the test body, pytest's monkeypatch would undo nothing here)
        for name in names:
            setattr(dist, name, no_collective)
        for _ in range(1 + dist.get_rank()):
            for p in model.parameters():
                p.grad = None
            F.mse_loss(model(x), y).backward()
        model.finish_grad_sync()  # nothing left to sync: no collective
        model.close()  # a second close does nothing
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    for got, want in zip(model.parameters(), expected):  # the rank's own grads, not averaged
        assert torch.equal(got.grad, want)
    assert all(torch.equal(b.grad_data, h) for b, h in zip(buckets, held))
    DDP(model.module, group, bucket_size=100)  # the module may be wrapped again
