"""A checkpoint appears whole or not at all, and a damaged one says which files are damaged:
a rank that raises or dies while saving leaves the previous checkpoint loadable and nothing new;
asynchronous saves write what the tensors held when ``save`` returned; missing, truncated and
garbled files, keys and shapes that differ, each named in one error."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from checkpoint_cases import assert_same, mlp
from ndweave.checkpoint import CheckpointError, CheckpointMismatchError, CorruptCheckpointError, load, save
from ndweave.checkpoint.commit import is_complete
from ndweave.mesh.testing import DistributedTestError, run_distributed


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fail_while_writing(how: str):
    """Make this rank's file writes fail: raise, or kill the process."""
    def write_data(self, plan, planner):
        if how == "die":
            os._exit(7)
        raise OSError("disk on fire")

    FileSystemWriter.write_data = write_data


def _save_then_fail(folder: str, how: str, asynchronous: bool = False) -> None:
    model = mlp(seed=0)
    save(f"{folder}/good", {"model": model})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    group = dist.new_group(backend="gloo") if asynchronous else None  # planned in the background too
    original = FileSystemWriter.write_data
    try:
        if dist.get_rank() == 1:
            _fail_while_writing(how)
        with pytest.raises(CheckpointError) as raised:
            save(f"{folder}/bad", {"model": model}, timeout=3, async_checkpoint=asynchronous, process_group=group).wait()
    finally:
        FileSystemWriter.write_data = original
    if dist.get_rank() == 0:  # the same error on every rank, naming the rank that failed
        assert ("disk on fire" if how == "raise" else "ranks [1] to finish writing") in str(raised.value)
    assert not os.path.exists(f"{folder}/bad")


def test_a_rank_raising_mid_save_leaves_the_previous_checkpoint(tmp_path):
    run_distributed(_save_then_fail, 2, str(tmp_path), "raise")
    partial = [p for p in os.listdir(tmp_path) if p.startswith(".bad.partial-")]
    assert len(partial) == 1 and not is_complete(tmp_path / partial[0])
    with pytest.raises(CheckpointError, match="uncommitted"):
        load(tmp_path / partial[0], {"model": mlp()})
    model = mlp(seed=1)
    load(tmp_path / "good", {"model": model})
    assert_same(_params(model), _params(mlp(seed=0)))


def test_a_rank_raising_while_an_async_save_writes_leaves_the_previous_checkpoint(tmp_path):
    run_distributed(_save_then_fail, 2, str(tmp_path), "raise", True)
    assert not is_complete(tmp_path / "bad")
    model = mlp(seed=1)
    load(tmp_path / "good", {"model": model})
    assert_same(_params(model), _params(mlp(seed=0)))


def test_async_save_writes_the_values_of_the_moment_it_returns(tmp_path):
    model = mlp(seed=0)
    before = _params(model)
    handle = save(tmp_path / "a", {"model": model}, async_checkpoint=True)
    assert handle.staged_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():  # training goes on while the files are written
        for p in model.parameters():
            p.mul_(-3.0)
    second = save(tmp_path / "b", {"model": model})  # the next save waits for the previous one
    assert handle.done() and is_complete(tmp_path / "a") and second.wait() == tmp_path / "b"
    assert handle.wait() == tmp_path / "a"
    for folder, expected in (("a", before), ("b", _params(model))):
        other = mlp(seed=1)
        load(tmp_path / folder, {"model": other})
        assert_same(_params(other), expected)


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    save(tmp_path / "c", {"model": mlp(seed=0), "step": 1})
    save(tmp_path / "c", {"model": mlp(seed=2), "step": 2})
    state = {"model": mlp(seed=1), "step": 0}
    load(tmp_path / "c", state)
    assert state["step"] == 2 and sorted(os.listdir(tmp_path)) == ["c"]
    assert_same(_params(state["model"]), _params(mlp(seed=2)))


def _save_two_ranks(folder: str) -> None:
    save(f"{folder}/two", {"model": mlp(seed=0)})


def test_damaged_files_are_named_in_one_error(tmp_path):
    run_distributed(_save_two_ranks, 2, str(tmp_path))
    files = sorted(f for f in os.listdir(tmp_path / "two") if f.endswith(".distcp"))
    assert len(files) == 2  # one per rank

    def damaged(name, damage):
        copy = tmp_path / name
        shutil.copytree(tmp_path / "two", copy)
        damage(copy)
        with pytest.raises(CorruptCheckpointError) as raised:
            load(copy, {"model": mlp(seed=1)})
        return raised.value

    def remove_and_truncate(folder):
        os.remove(folder / files[0])
        with open(folder / files[1], "r+b") as f:
            f.truncate(10)

    error = damaged("broken", remove_and_truncate)
    assert error.files == files and "missing" in str(error) and "10 bytes" in str(error)

    def garble(folder):  # same size, unreadable content
        size = os.path.getsize(folder / files[1])
        with open(folder / files[1], "r+b") as f:
            f.write(b"\0" * size)

    assert damaged("garbled", garble).files == [files[1]]

    def garble_metadata(folder):
        (folder / ".ndweave-complete").unlink()  # a plain DCP checkpoint: the metadata is all there is
        (folder / ".metadata").write_bytes(b"not a pickle")

    assert damaged("no-metadata", garble_metadata).files == [".metadata"]


class Wider(torch.nn.Module):
    """The MLP with another hidden width and an extra layer."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
        self.head = torch.nn.Linear(3, 3)

    def state_dict(self, *args, **kwargs):  # the MLP's names, plus the head
        return {k.removeprefix("layers."): v for k, v in super().state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict, strict=True):
        fixed = {(k if k.startswith("head.") else f"layers.{k}"): v for k, v in state_dict.items()}
        return super().load_state_dict(fixed, strict=strict)


def test_keys_and_shapes_that_differ_are_each_named(tmp_path):
    original = mlp(seed=0)
    save(tmp_path / "m", {"model": original, "step": 3})
    with pytest.raises(CheckpointMismatchError) as raised:
        load(tmp_path / "m", {"model": Wider(), "epoch": 0})
    error = raised.value
    assert error.missing == ["epoch", "model.head.bias", "model.head.weight"]
    assert error.unexpected == []
    assert [line.split(":")[0] for line in error.mismatched] == ["model.0.bias", "model.0.weight", "model.2.weight"]
    assert "(8, 4) in the checkpoint, (9, 4) in the state" in str(error)

    # strict=False: what matches loads, the rest stays, and the lists come back
    wider = Wider()
    head = _params(wider.head)
    result = load(tmp_path / "m", {"model": wider}, strict=False)
    assert result.mismatched == error.mismatched and result.missing == ["model.head.bias", "model.head.weight"]
    assert torch.equal(wider.layers[2].bias, original[2].bias)
    assert_same(_params(wider.head), head)

    smaller = torch.nn.Sequential(torch.nn.Linear(4, 8))  # loads into a model lacking a layer
    with pytest.raises(CheckpointMismatchError) as raised:
        load(tmp_path / "m", {"model": smaller})
    assert raised.value.unexpected == ["model.2.bias", "model.2.weight"]


def _load_wider(folder: str) -> list[str]:
    with pytest.raises(CheckpointMismatchError) as raised:
        load(f"{folder}/two", {"model": Wider()})
    return raised.value.missing + raised.value.mismatched


def test_a_mismatch_raises_the_same_error_on_every_rank(tmp_path):
    run_distributed(_save_two_ranks, 2, str(tmp_path))
    first, second = run_distributed(_load_wider, 2, str(tmp_path))
    assert first == second and first[:2] == ["model.head.bias", "model.head.weight"] and len(first) == 5


# last in the file: the dead rank takes its pool down, the next 2-rank test starts a new one
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(DistributedTestError) as failed:
        run_distributed(_save_then_fail, 2, str(tmp_path), "die")
    assert {f.rank: f.kind for f in failed.value.failures} == {1: "died"}  # rank 0 gave up waiting, as asserted
    assert not (tmp_path / "bad").exists()
    model = mlp(seed=1)
    load(tmp_path / "good", {"model": model})
    assert_same(_params(model), _params(mlp(seed=0)))


def _load_mismatched_on_one_rank(folder: str) -> str:
    save(f"{folder}/one", {"model": mlp(seed=0), "step": 3})
    # rank 1 alone loads into another model (a wider one with an extra layer), then rank 1 alone
    # names an entry the checkpoint lacks: every rank raises, none waits in the load's collectives
    state = {"model": Wider() if dist.get_rank() == 1 else mlp(seed=1)}
    with pytest.raises(CheckpointMismatchError) as raised:
        load(f"{folder}/one", state)
    assert "head.weight" in str(raised.value) and "different global shape" in str(raised.value)
    state = {"model": mlp(seed=1), **({"epoch": 0} if dist.get_rank() == 1 else {})}
    with pytest.raises(CheckpointMismatchError, match="missing from the checkpoint"):
        load(f"{folder}/one", state)
    return str(raised.value)


def test_a_mismatch_on_one_rank_only_raises_on_every_rank(tmp_path):
    messages = run_distributed(_load_mismatched_on_one_rank, 2, str(tmp_path), timeout=60)
    assert messages[0] == messages[1]  # the same error, naming what rank 1 got wrong
