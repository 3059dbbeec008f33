"""DP ranks that stop running the same forwards, backwards and syncs raise the same clear error on
every rank, in seconds (no hang until the timeout, no silently wrong average); ranks in step pass."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_cases import MLP, batch, rows
from ndweave.ddp import DDP, GradSyncDivergedError
from ndweave.mesh.lifecycle import failed_ranks
from ndweave.mesh.testing import distributed

# A group of its own with a short timeout: a fault test leaves a reduction without its partner, which
# then fails in 5 s on that group rather than waiting on the pool's default group for the next test.
TIMEOUT_S = 5


def _setup(**kwargs):
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=TIMEOUT_S))
    model = DDP(MLP(), group, bucket_size=100, **kwargs)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _micro_batch(step: int):
    x, y = batch(step)
    rank, size = dist.get_rank(), dist.get_world_size()
    return rows(x, rank, size), rows(y, rank, size)


def _train_step(model, opt, step: int, *, backward: bool = True) -> None:
    x, y = _micro_batch(step)
    loss = F.mse_loss(model(x), y)
    if backward:
        loss.backward()
    opt.step()
    opt.zero_grad()


@distributed(world_size=2)
def test_a_rank_that_skips_backward_is_named_on_every_rank():
    model, opt = _setup()
    _train_step(model, opt, 0)
    start = time.monotonic()
    with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) finishes grad sync #2 after 1 backward "
                                                    r"pass\(es\) and 2 forward\(s\).*: rank 1 skipped a backward\(\)"):
        if dist.get_rank() == 1:  # the skipped step: its next backward pairs with rank 0's first
            _train_step(model, opt, 1, backward=False)
        _train_step(model, opt, 2)
    assert time.monotonic() - start < TIMEOUT_S


@distributed(world_size=2)
def test_a_step_without_backward_on_one_rank_is_caught_before_the_optimizer_waits():
    # what ndweave.optim's optimizers do in step(): finish the grad sync, then collectives of their own
    model, opt = _setup()
    _train_step(model, opt, 0)
    model.finish_grad_sync()  # the optimizer's usual call after backward: no check
    start = time.monotonic()
    with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) called step\(\) a 2nd time, with 0 "
                                                    r"forward\(s\) and no backward since grad sync #1; DP rank 0 "
                                                    r"finishes grad sync #2.*: rank 1 called step\(\) once more"):
        if dist.get_rank() == 0:
            x, y = _micro_batch(1)
            F.mse_loss(model(x), y).backward()
        else:
            model.finish_grad_sync()  # an extra step: rank 0 is in its next backward's sync
    assert time.monotonic() - start < TIMEOUT_S


@distributed(world_size=2)
def test_a_step_more_after_a_sync_finished_outside_backward_is_caught():
    """With finish_grad_sync_in_backward=False the optimizer's finish_grad_sync() is the one that finishes
    the sync, so the next call with no backward since is already a step more (it went unchecked)."""
    model, opt = _setup(finish_grad_sync_in_backward=False)
    x, y = _micro_batch(0)
    F.mse_loss(model(x), y).backward()
    model.finish_grad_sync()  # the optimizer's call, finishing the sync
    with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) called step\(\) a 2nd time, with 0 "
                                                    r"forward\(s\) and no backward since grad sync #1.*: rank 1 "
                                                    r"called step\(\) once more than DP rank 0"):
        if dist.get_rank() == 1:
            model.finish_grad_sync()  # a step more, while rank 0 goes on to its next sync
        x, y = _micro_batch(1)
        F.mse_loss(model(x), y).backward()
        model.finish_grad_sync()


@distributed(world_size=2)
def test_no_sync_on_one_rank_only_is_named():
    model, opt = _setup()
    with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) finishes grad sync #1 after 2 backward "
                                                    r"pass\(es\) \(1 under no_sync\(\)\).*: rank 1 entered no_sync\(\) "
                                                    r"for 1 backward\(s\) of this grad sync, DP rank 0 for 0: enter "
                                                    r"it on every rank"):
        for micro in range(2):
            x, y = _micro_batch(micro)
            if dist.get_rank() == 1 and micro == 0:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
            else:
                F.mse_loss(model(x), y).backward()
                if dist.get_rank() == 0:
                    break  # rank 0 synced its first micro-batch: one backward per sync



@distributed(world_size=2)
def test_a_rank_that_skips_its_step_is_named_before_the_optimizer_collectives():
    """An exception caught between backward and step on one rank: its next backward's reductions would
    pair with the others' optimizer collectives (gloo aborts, or a silently wrong sum)."""
    model, _ = _setup()
    x, y = _micro_batch(0)
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
        model.finish_grad_sync()  # the optimizer's step, on every rank
    start = time.monotonic()
    with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) finishes grad sync #4 after 1 backward "
                                                    r"pass\(es\) and 1 forward\(s\), 2 step\(\)s so far; DP rank 0 "
                                                    r"called step\(\) a 3rd time.*: rank 1 skipped a step\(\) DP rank 0 "
                                                    r"called"):
        F.mse_loss(model(x), y).backward()
        if dist.get_rank() == 0:
            model.finish_grad_sync()  # its step; rank 1 caught an error and goes on to the next backward
        F.mse_loss(model(x), y).backward()
    assert time.monotonic() - start < TIMEOUT_S


@distributed(world_size=2)
def test_zero2_no_sync_on_one_rank_for_a_backward_is_named_before_its_reductions():
    model, _ = _setup(zero_stage=2)
    x, y = _micro_batch(0)
    with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) starts backward pass 1 under no_sync\(\)"
                                                    r".*: rank 1 entered no_sync\(\) for this backward, DP rank 0 did "
                                                    r"not: enter it on every rank or on none"):
        with model.no_sync() if dist.get_rank() == 1 else contextlib.nullcontext():
            F.mse_loss(model(x), y).backward()


@distributed(world_size=2)
def test_a_rank_whose_peers_never_come_gives_up_within_the_check_bound_and_tells_them():
    """Rank 1 steps once more while rank 0 is elsewhere (not in shutdown()): rank 1 gives up after
    ``desync_timeout`` (60 s by default; 2 s here), not the group's 30 s, and announces its error, which
    rank 0 reads."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    model = DDP(MLP(), group, bucket_size=100, desync_timeout=2)
    x, y = _micro_batch(0)
    F.mse_loss(model(x), y).backward()
    model.finish_grad_sync()
    if dist.get_rank() == 1:
        start = time.monotonic()
        with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) called step\(\) a 2nd time.*did not "
                                                        r"come to the DP ranks' check \(waited 2\.\d s\): rank 1 ran "
                                                        r"a step\(\) they did not"):
            model.finish_grad_sync()
        assert time.monotonic() - start < 4
    else:
        deadline, told = time.monotonic() + 10, {}
        while not told and time.monotonic() < deadline:
            told = failed_ranks([1])
            time.sleep(0.05)
        assert told[1].startswith("GradSyncDivergedError: rank 1 (DP rank 1) called step() a 2nd time")
    dist.barrier()  # both done, before the harness forgets rank 1's announcement


@distributed(world_size=2)
def test_ranks_in_step_pass_the_checks():
    """no_sync accumulation, repeated finish_grad_sync() calls, steps without backward on every rank and
    a forward under no_grad on one rank only: every check agrees, and the grads are the same as with
    the check off."""
    grads = {}
    for detect in (True, False):
        model, opt = _setup(detect_desync=detect)
        opt.step()  # no backward yet, on every rank
        model.finish_grad_sync()
        for step in range(3):
            x, y = _micro_batch(step)
            with model.no_sync():
                F.mse_loss(model(x[:2]), y[:2]).backward()
            F.mse_loss(model(x[2:]), y[2:]).backward()
            model.finish_grad_sync()
            model.finish_grad_sync()
            if dist.get_rank() == 0:
                with torch.no_grad():
                    model(x)
            opt.step()
            opt.zero_grad()
        grads[detect] = [p.detach().clone() for p in model.parameters()]
    for with_check, without in zip(grads[True], grads[False]):
        assert torch.equal(with_check, without)


@distributed(world_size=2)
def test_detect_desync_false_checks_nothing():
    model, opt = _setup(detect_desync=False)
    if dist.get_rank() == 1:
        model(_micro_batch(0)[0])  # a forward without backward on one rank: caught only with the check
    _train_step(model, opt, 1)


@distributed(world_size=2)
def test_a_param_frozen_at_wrap_time_and_unfrozen_later_is_refused():
    base = MLP()
    base.fc1.weight.requires_grad_(False)
    base.fc2.weight.requires_grad_(False)
    group = dist.new_group(list(range(dist.get_world_size())))
    model = DDP(base, group, params_to_ignore=["fc2.weight"])
    base.fc2.weight.requires_grad_(True)  # ignored by choice: the user's to handle
    x, y = _micro_batch(0)
    F.mse_loss(model(x), y).backward()
    base.fc1.weight.requires_grad_(True)
    with torch.no_grad():
        model(x)  # evaluation is harmless
    with pytest.raises(RuntimeError, match=r"\['fc1.weight'\] had requires_grad=False when DDP wrapped the model"):
        model(x)


@pytest.mark.parametrize("skipped", ["first", "last"])
@distributed(world_size=2)
def test_zero2_a_rank_that_skips_a_micro_batch_backward_is_named_before_its_reductions(skipped):
    """ZeRO-2 reduces (and waits) inside every backward, so the ranks agree before each backward: a
    skipped one is named in seconds, not left to pair reductions of different micro-batches."""
    model, _ = _setup(zero_stage=2)
    x, y = _micro_batch(0)
    for i in range(2):
        F.mse_loss(model(x), y).backward()  # two full steps in step
    model.zero_grad_buffer()
    start = time.monotonic()
    with pytest.raises(GradSyncDivergedError, match=r"rank 1 \(DP rank 1\) .*2 forward\(s\).*: rank 1 skipped a "
                                                    r"backward\(\)"):
        for i in range(2):
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                loss = F.mse_loss(model(x), y)
                if dist.get_rank() == 0 or i != ("first", "last").index(skipped):
                    loss.backward()
        model.finish_grad_sync()
    assert time.monotonic() - start < TIMEOUT_S


@distributed(world_size=2)
def test_the_check_after_backward_rides_the_last_buckets_all_reduce(monkeypatch):
    """On gloo the rows of the check after backward travel after the last bucket, in its all-reduce: no
    gather of their own. The optimizer's step() still gathers (its collectives could pair otherwise)."""
    from ndweave.ddp import desync

    gathers = []
    real = desync.gather_rows
    monkeypatch.setattr(desync, "gather_rows", lambda *a, **k: gathers.append(a[2][0]) or real(*a, **k))
    model, opt = _setup()
    assert model._carried is not None and model._carrier.numel() > model.grad_buckets()[-1].numel
    for step in range(3):
        _train_step(model, opt, step)
        model.finish_grad_sync()  # an ndweave optimizer's step(): the one gather
    assert gathers == [2, 2, 2]  # (kind 2: a step; kind 1, after backward, never)
    rows = model._carried.rows()
    assert rows[0] == rows[1] and rows[0][:2] == (1, 3)  # both ranks' rows, summed in: sync #3 after backward


@distributed(world_size=2)
def test_a_rank_late_at_a_check_is_waited_for_not_named():
    """A rank that comes to a check seconds late (a slow data loader) finds its peer's row posted on the
    board: rows that agree are no error, and the next checks pair as before."""
    model, opt = _setup()
    for step in range(4):
        if dist.get_rank() == step % 2:
            time.sleep(0.7)  # past two of the waiting rank's slices: it posts its row and reads the board
        _train_step(model, opt, step)
        model.finish_grad_sync()
    reference, ref_opt = _setup(detect_desync=False)
    for step in range(4):
        _train_step(reference, ref_opt, step)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_carried_rows_sum_to_every_ranks_row_exactly(dtype):
    from ndweave.ddp.check_wait import CarriedRows

    rows = [(1, 2**31 - 1, 0, 255, 256, 65535, 3, 2**32 + 5), (4, 0, 7, 1, 2**24 + 1, 9, 0, 1), (0,) * 8]
    total = torch.zeros(CarriedRows.numel(3, 8), dtype=dtype)
    for index, row in enumerate(rows):  # what the all-reduce sums: each rank's region, zeros but its slot
        region = torch.full((CarriedRows.numel(3, 8),), 7.0, dtype=dtype)  # (stale values: written over)
        CarriedRows(region, index, 3, 8).write(row)
        total += region
    assert CarriedRows(total, 0, 3, 8).rows() == [tuple(v % 2**32 for v in row) for row in rows]


@distributed(world_size=2)
def test_finish_grad_sync_for_step_hands_out_a_waiter_only_where_the_check_is_carried():
    """Where the check after backward rides the buckets (gloo, ZeRO 0/1), an optimizer whose step's
    collectives run apart gets a waiter and no check is gathered; elsewhere the check is gathered as in
    finish_grad_sync(), and there is no waiter."""
    from ndweave.mesh.contracts import CheckedStepSync, StepWaiter

    for kwargs, carried in (({}, True), ({"zero_stage": 1}, True), ({"zero_stage": 2}, False),
                            ({"detect_desync": False}, False)):
        model, opt = _setup(**kwargs)
        assert isinstance(model, CheckedStepSync)
        _train_step(model, opt, 0)
        waiter = model.finish_grad_sync_for_step()
        assert isinstance(waiter, StepWaiter) if carried else waiter is None
        if carried:  # a collective of the step, waited for through it
            side = dist.new_group([0, 1], backend="gloo")
            value = torch.tensor([dist.get_rank() + 1.0])
            waiter.wait(dist.all_reduce(value, group=side, async_op=True), [value])
            assert value.item() == 3.0
        _train_step(model, opt, 1)  # the counts agree after it
