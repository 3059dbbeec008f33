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


def test_a_block_compiled_and_assigned_back_saves_and_loads_under_the_models_own_names(tmp_path):
    """``model[0] = torch.compile(model[0])`` puts ``_orig_mod.`` in the module's FQNs; the checkpoint
    keeps the model's own names (as torch's ``get_model_state_dict``), so it loads into the model
    uncompiled, and a checkpoint of the model uncompiled loads into the compiled one, optimizer state
    included."""
    from torch.distributed.checkpoint import FileSystemReader

    from checkpoint_cases import step

    compiled = mlp(seed=0)
    compiled[0] = torch.compile(compiled[0], backend="eager")
    assert "0._orig_mod.weight" in compiled.state_dict()
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=0.1)
    step(compiled, optimizer, seed=1)
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save(1, {"model": compiled, "optimizer": optimizer})
    saved = FileSystemReader(tmp_path / "step_00000001").read_metadata().state_dict_metadata
    assert "model.0.weight" in saved and not any("_orig_mod" in key for key in saved), sorted(saved)

    plain = mlp(seed=2)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1)
    step(plain, plain_optimizer, seed=3)  # (state to overwrite)
    assert manager.load_latest({"model": plain, "optimizer": plain_optimizer}) == 1
    assert torch.equal(plain[0].weight, compiled[0].weight) and torch.equal(plain[2].bias, compiled[2].bias)
    assert torch.equal(plain_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])

    manager.save(2, {"model": plain, "optimizer": plain_optimizer})  # and back: plain into the compiled model
    again = mlp(seed=4)
    again[0] = torch.compile(again[0], backend="eager")
    again_optimizer = torch.optim.AdamW(again.parameters(), lr=0.1)
    step(again, again_optimizer, seed=5)
    assert manager.load_latest({"model": again, "optimizer": again_optimizer}) == 2
    assert torch.equal(again[0]._orig_mod.weight, plain[0].weight)
    assert torch.equal(again_optimizer.state_dict()["state"][1]["exp_avg_sq"],
                       plain_optimizer.state_dict()["state"][1]["exp_avg_sq"])
