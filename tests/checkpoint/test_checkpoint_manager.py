"""``CheckpointManager``: step folders, only complete checkpoints count, the newest is found again,
old ones and leftovers of crashed saves are removed after the next commit."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from checkpoint_cases import mlp
from ndweave.checkpoint import CheckpointManager
from ndweave.checkpoint import saver
from ndweave.mesh.testing import distributed
from ndweave.mesh.torch_compat import group_timeout, live_groups


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path / "run", keep_last=2)
    assert manager.latest() is None and manager.steps() == []
    model = mlp(seed=0)
    handles = [manager.save(step, {"model": model, "step": step}, async_checkpoint=step % 2 == 0)
               for step in (100, 200, 300, 400)]
    handles[-1].wait()
    assert manager.steps() == [300, 400] and manager.latest() == 400
    assert sorted(os.listdir(tmp_path / "run")) == ["step_00000300", "step_00000400"]


def test_the_newest_complete_checkpoint_loads_and_crashed_saves_are_ignored(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=None)
    fresh = {"model": mlp(seed=1), "step": 0}
    assert manager.load_latest(fresh) is None and fresh["step"] == 0  # a fresh start loads nothing

    manager.save(5, {"model": mlp(seed=0), "step": 5})
    (tmp_path / ".step_00000006.partial-0123").mkdir()  # a save that crashed
    (tmp_path / "step_00000007").mkdir()  # a folder that was never committed
    (tmp_path / "step_00000007" / "__0_0.distcp").write_bytes(b"half")
    assert manager.steps() == [5]
    state = {"model": mlp(seed=1), "step": 0}
    assert manager.load_latest(state) == 5 and state["step"] == 5
    assert torch.equal(state["model"][0].weight, mlp(seed=0)[0].weight)

    manager.save(8, {"model": mlp(seed=0), "step": 8})
    assert not (tmp_path / ".step_00000006.partial-0123").exists()  # leftovers go after the next commit
    assert (tmp_path / "step_00000007").exists()  # not ours to delete
    assert manager.steps() == [5, 8]


def test_keep_last_must_keep_something():
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager("x", keep_last=0)


@distributed(world_size=2)
def test_close_commits_the_pending_async_save_then_destroys_the_managers_group(tmp_path):
    manager = CheckpointManager(tmp_path, async_checkpoint=True, timeout=20)
    handle = manager.save(1, {"model": mlp(seed=0), "step": 1})
    group = manager._process_group  # made by the first async save, tagged, with the manager's timeout
    assert group.group_desc == "ndweave:checkpoint-planning" and group_timeout(group) == timedelta(seconds=20)
    manager.close()
    assert handle.done() and manager.steps() == [1]  # committed on every rank before close() returned
    assert group not in live_groups()
    manager.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="is closed: make a new one to save again"):
        manager.save(2, {"model": mlp(seed=0), "step": 2})


def test_a_manager_closes_on_leaving_its_block_and_raises_what_its_last_save_raised(tmp_path, monkeypatch):
    assert CheckpointManager(tmp_path).timeout == 300  # ndweave's collective timeout, not torch's 30 minutes
    with CheckpointManager(tmp_path, async_checkpoint=True) as manager:
        handle = manager.save(1, {"model": mlp(seed=0), "step": 1})
    assert handle.done() and manager.steps() == [1]

    def fails() -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(saver, "_yield_to_training", fails)  # the background thread fails before writing
    manager = CheckpointManager(tmp_path, async_checkpoint=True)
    manager.save(2, {"model": mlp(seed=0), "step": 2})
    with pytest.raises(OSError, match="disk gone"):
        manager.close()
    manager.close()  # raised once: closed all the same
    manager = CheckpointManager(tmp_path, async_checkpoint=True)
    with pytest.raises(OSError, match="disk gone"):
        manager.save(3, {"model": mlp(seed=0), "step": 3}).wait()
    manager.close()  # the error was raised by wait() already: not again
    assert manager.steps() == [1]
