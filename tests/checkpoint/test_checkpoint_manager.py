"""``CheckpointManager``: step folders, only complete checkpoints count, the newest is found again,
old ones and leftovers of crashed saves are removed after the next commit."""

from __future__ import annotations

import os

import pytest
import torch

from checkpoint_cases import mlp
from ndweave.checkpoint import CheckpointManager


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
