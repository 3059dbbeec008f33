"""Asynchronous saves copy parameters and optimizer state in the background: training goes on at
once, each optimizer's next ``step()`` waits for the copy (a step pre-hook), and the checkpoint
holds the values of the moment ``save`` was called. The copy is slowed down here, so a step that did
not wait, or a buffer copied late, would change what is saved. With the planning in the background,
what a rank alone writes is copied before it, so the step need not wait for the planning; the files
are written without ``torch.save``'s CRC32, and an async save's at a lower priority."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh

from checkpoint_cases import Fused, assert_same
from ndweave.checkpoint import CheckpointError, CheckpointManager, StagingBuffers, load, save
from ndweave.checkpoint.pieces import PieceSavePlanner
from ndweave.checkpoint.saver import WRITER_NICENESS
from ndweave.checkpoint.staging import StagingGate
from ndweave.mesh.testing import full_tensor, run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One step: forward updates BatchNorm's running stats, ``step()`` params and Adam's state."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every saved tensor by name: the module's state dict and the optimizer's state by FQN."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": full_tensor(v).clone() for k, v in model.state_dict().items()}
    for param, entry in optimizer.state.items():
        out.update({f"optimizer.{names[id(param)]}.{k}": full_tensor(v).clone() for k, v in entry.items()})
    return out


def _reloaded(folder, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    load(folder, {"model": model, "optimizer": optimizer})
    return _snapshot(model, optimizer)


class _SlowCopy:
    """Patch the background copy: ``delay`` seconds before each part of it (or raise ``error``);
    records when it ended (the first part copies all of it when no other rank holds any of it)."""

    def __init__(self, delay: float = 0.0, error: BaseException | None = None) -> None:
        self.delay, self.error, self.finished_at = delay, error, None
        self.original = PieceSavePlanner.stage_deferred

    def __enter__(self) -> _SlowCopy:
        def stage_deferred(planner, **kwargs):
            time.sleep(self.delay)
            if self.error is not None:
                raise self.error
            self.original(planner, **kwargs)
            if not planner.deferred and self.finished_at is None:
                self.finished_at = time.perf_counter()

        PieceSavePlanner.stage_deferred = stage_deferred
        return self

    def __exit__(self, *exc) -> None:
        PieceSavePlanner.stage_deferred = self.original


def _gates(optimizer: torch.optim.Optimizer) -> list[StagingGate]:
    """The save hooks an optimizer holds (its pre-hook dict, reached through a probe's handle)."""
    probe = optimizer.register_step_pre_hook(lambda *args: None)
    hooks = list(probe.hooks_dict_ref().values())
    probe.remove()
    return [h for h in hooks if isinstance(h, StagingGate)]


def test_training_right_after_an_async_save_does_not_change_what_it_writes(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, seed=0)  # Adam's state exists
    expected = _snapshot(model, optimizer)
    step_began: list[float] = []
    with _SlowCopy(delay=0.4) as copy:
        handle = save(tmp_path / "a", {"model": model, "optimizer": optimizer}, async_checkpoint=True)
        assert not handle.done() and len(_gates(optimizer)) == 1
        # registered after the save's hook: runs once that one let the step through
        optimizer.register_step_pre_hook(lambda *args: step_began.append(time.perf_counter()))
        for seed in (1, 2):  # forwards (running stats) while the copy runs, then the steps
            _train(model, optimizer, seed)
        handle.wait()
    assert copy.finished_at is not None and step_began[0] >= copy.finished_at
    assert _gates(optimizer) == []  # wait() removed the hook
    assert not torch.equal(model[1].running_mean, expected["model.1.running_mean"])  # training went on
    other = _model()
    assert_same(_reloaded(tmp_path / "a", other, torch.optim.AdamW(other.parameters(), lr=0.1)), expected)


def test_without_an_optimizer_everything_is_copied_before_returning(tmp_path):
    model = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with _SlowCopy(error=AssertionError("nothing may be left for the background copy")):
        handle = save(tmp_path / "a", {"model": model, "step": torch.tensor(3)}, async_checkpoint=True)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3.0)
        handle.wait()
    other = _model()
    load(tmp_path / "a", {"model": other})
    assert_same(other.state_dict(), expected)


def test_wait_staged_lets_tensors_be_changed_by_hand_and_later_saves_remove_finished_hooks(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, seed=0)
    expected = _snapshot(model, optimizer)
    with _SlowCopy(delay=0.3):
        handle = save(tmp_path / "a", {"model": model, "optimizer": optimizer}, async_checkpoint=True)
        handle.wait_staged()  # e.g. before an EMA update of the weights
        assert _gates(optimizer) == []
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        handle.wait()
    other = _model()
    assert_same(_reloaded(tmp_path / "a", other, torch.optim.AdamW(other.parameters(), lr=0.1)), expected)

    # nobody waits: the finished hook stays a no-op until the next save of the same optimizer
    first = save(tmp_path / "b", {"model": model, "optimizer": optimizer}, async_checkpoint=True)
    _train(model, optimizer, seed=1)
    assert len(_gates(optimizer)) == 1 and _gates(optimizer)[0].finished()
    save(tmp_path / "c", {"model": model, "optimizer": optimizer}, async_checkpoint=True).wait()
    assert first.done() and _gates(optimizer) == []


def test_a_failed_copy_raises_from_the_next_step_and_from_wait(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _SlowCopy(error=OSError("out of host memory")):
        handle = save(tmp_path / "a", {"model": model, "optimizer": optimizer}, async_checkpoint=True)
        with pytest.raises(CheckpointError, match="out of host memory"):
            optimizer.step()  # raised before the step changed anything
        assert_same(model.state_dict(), before)
        _train(model, optimizer, seed=1)  # reported once: training may go on
        with pytest.raises(CheckpointError, match="out of host memory"):
            handle.wait()
        with pytest.raises(CheckpointError, match="out of host memory"):
            handle.wait_staged()
    assert not os.path.exists(tmp_path / "a") and _gates(optimizer) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_files_are_written_without_crc32_and_async_ones_at_a_lower_priority(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, seed=0)
    expected = _snapshot(model, optimizer)
    seen, original = [], FileSystemWriter.write_data

    def write_data(writer, plan, planner):
        me = threading.get_native_id()
        seen.append((torch.serialization.get_crc32_options(), os.getpriority(os.PRIO_PROCESS, me)))
        return original(writer, plan, planner)

    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    FileSystemWriter.write_data = write_data
    try:
        save(tmp_path / "sync", {"model": model, "optimizer": optimizer})
        save(tmp_path / "async", {"model": model, "optimizer": optimizer}, async_checkpoint=True).wait()
    finally:
        FileSystemWriter.write_data = original
    assert seen == [(False, caller), (False, min(caller + WRITER_NICENESS, 19))]
    assert torch.serialization.get_crc32_options()  # the caller's setting: torch keeps it per thread
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    for folder in ("sync", "async"):  # plain DCP reads them (it never checks the CRC)
        sd = {"model": _model().state_dict()}
        dcp.load(sd, checkpoint_id=tmp_path / folder)
        assert_same(sd["model"], {k[len("model."):]: v for k, v in expected.items() if k.startswith("model.")})


def test_reused_buffers_hold_each_save_own_values(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, seed=0)
    manager = CheckpointManager(tmp_path, keep_last=None, async_checkpoint=True, reuse_buffers=True)
    expected = {}
    for step in (1, 2, 3):
        expected[step] = _snapshot(model, optimizer)
        manager.save(step, {"model": model, "optimizer": optimizer})
        kept = {id(b) for b in manager.buffers._buffers.values()}
        _train(model, optimizer, seed=step)  # waits for the copy, then changes every saved tensor
    manager.save(4, {"model": model}).wait()  # another state: the optimizer's buffers are dropped
    assert kept and {id(b) for b in manager.buffers._buffers.values()} < kept  # the model's reused
    assert manager.buffers.nbytes == sum(v.numel() * v.element_size() for v in model.state_dict().values())
    for step in (1, 2, 3):
        other = _model()
        assert_same(_reloaded(manager.path(step), other, torch.optim.AdamW(other.parameters(), lr=0.1)),
                     expected[step])


def _train_sharded(model: Fused, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """A step on DTensor params (grads made up), and a buffer changed outside the step."""
    model.seen.add_(1.0)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.1 * seed + 0.05)
    optimizer.step()


def _async_with_dtensor_params(folder: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # the planning runs in the calling thread on the default group, or in the background on a
    # group of the save's own (what CheckpointManager does)
    staged = []
    for name, group in (("default group", None), ("own group", dist.new_group(backend="gloo"))):
        model = Fused(mesh)  # StridedShard weight (written as PieceSets) and a Shard(0) bias
        model.register_buffer("seen", torch.zeros(4))
        model.scale = nn.Parameter(torch.ones(3))  # replicated: rank 0 writes it, rank 1 copies nothing
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        _train_sharded(model, optimizer, seed=0)
        expected = _snapshot(model, optimizer)
        with _SlowCopy(delay=0.3) as copy:
            handle = save(f"{folder}/{name}", {"model": model, "optimizer": optimizer}, async_checkpoint=True,
                          process_group=group)
            _train_sharded(model, optimizer, seed=1)
            handle.wait()
        assert copy.finished_at is not None
        staged.append(handle.staged_bytes)
        other = Fused(mesh, seed=1)
        other.register_buffer("seen", torch.full((4,), -1.0))
        other.scale = nn.Parameter(torch.zeros(3))
        assert_same(_reloaded(f"{folder}/{name}", other, torch.optim.Adam(other.parameters(), lr=0.1)), expected)
    # what this rank writes either way (DCP gives each replicated value to one rank), not the
    # superset its local plan held when the planning ran in the background
    assert staged[0] == staged[1]


def test_sharded_params_and_state_on_two_ranks_are_saved_as_of_the_call(tmp_path):
    run_distributed(_async_with_dtensor_params, 2, str(tmp_path))


class _SlowPlanning:
    """Patch the global plan: rank 0 takes ``delay`` seconds longer; records when this rank had its
    final plan."""

    def __init__(self, delay: float) -> None:
        self.delay, self.planned_at = delay, None
        self.originals = PieceSavePlanner.create_global_plan, PieceSavePlanner.finish_plan

    def __enter__(self) -> _SlowPlanning:
        create, finish = self.originals

        def create_global_plan(planner, plans):
            time.sleep(self.delay)
            return create(planner, plans)

        def finish_plan(planner, plan):
            self.planned_at = time.perf_counter()
            return finish(planner, plan)

        PieceSavePlanner.create_global_plan, PieceSavePlanner.finish_plan = create_global_plan, finish_plan
        return self

    def __exit__(self, *exc) -> None:
        PieceSavePlanner.create_global_plan, PieceSavePlanner.finish_plan = self.originals


def _step_waits_for_the_planning_only_for_replicated_values(folder: str) -> list[bool]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    group = dist.new_group(backend="gloo")
    waited = []
    for replicated in (False, True):
        model = Fused(mesh, strided=False)  # Shard(1) weight, Shard(0) bias: each rank writes its own
        model.register_buffer("seen", torch.zeros(4))  # copied before save returns
        if replicated:  # DCP's global plan gives it to one rank: copied once the plan is known
            model.scale = nn.Parameter(torch.ones(3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        _train_sharded(model, optimizer, seed=0)
        expected = _snapshot(model, optimizer)
        step_began: list[float] = []
        with _SlowPlanning(delay=0.5) as planning:
            handle = save(f"{folder}/{replicated}", {"model": model, "optimizer": optimizer},
                          async_checkpoint=True, process_group=group)
            optimizer.register_step_pre_hook(lambda *args: step_began.append(time.perf_counter()))
            _train_sharded(model, optimizer, seed=1)
            handle.wait()
        waited.append(step_began[0] >= planning.planned_at)
        other = Fused(mesh, strided=False, seed=1)
        other.register_buffer("seen", torch.full((4,), -1.0))
        if replicated:
            other.scale = nn.Parameter(torch.zeros(3))
        assert_same(_reloaded(f"{folder}/{replicated}", other, torch.optim.Adam(other.parameters(), lr=0.1)),
                    expected)
    return waited


def test_with_a_group_of_its_own_the_step_waits_for_the_planning_only_for_replicated_values(tmp_path):
    # the planning waits for every rank (rank 0 slowed down here); what no other rank holds is in
    # the final plan whatever it says, so it is copied first and the step goes on before it ends
    assert run_distributed(_step_waits_for_the_planning_only_for_replicated_values, 2, str(tmp_path)) == [
        [False, True], [False, True]]


def _failure_before_planning_in_the_background(folder: str) -> None:
    group = dist.new_group(backend="gloo")
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": optimizer, "bad": _Unsavable() if dist.get_rank() == 1 else 0}
    if dist.get_rank() == 1:
        with pytest.raises(CheckpointError, match="cannot be saved"):
            save(f"{folder}/a", state, async_checkpoint=True, process_group=group)
    else:  # the call returns; the failure on rank 1 arrives with the background planning
        handle = save(f"{folder}/a", state, async_checkpoint=True, process_group=group)
        with pytest.raises(CheckpointError, match="cannot be saved"):
            handle.wait()
    dist.barrier()
    assert not os.path.exists(f"{folder}/a")
    subset = dist.new_group(ranks=[0], backend="gloo")
    with pytest.raises(ValueError, match="a group of all of them"):
        save(f"{folder}/b", {"model": model}, async_checkpoint=True, process_group=subset)


class _Unsavable:
    def state_dict(self):
        raise ValueError("this entry cannot be saved")

    def load_state_dict(self, state):
        pass


def test_a_rank_failing_before_background_planning_fails_the_save_on_every_rank(tmp_path):
    run_distributed(_failure_before_planning_in_the_background, 2, str(tmp_path))
