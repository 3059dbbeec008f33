"""DistributedOptimizer state through torch's distributed checkpoint (DCP) alone: ``state_dict()``'s
ranges are refused on every rank while DCP plans (nothing written, nothing read), and
``state_dict(format="dcp")`` saves at DP=2 x TP=2 and resumes at DP=4 and at DP=2 x TP=2 equal to
one process's uninterrupted run (float64, strict)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from ndweave.mesh.contracts import StatePiece
from ndweave.mesh.testing import distributed, run_distributed
from ndweave.optim import DistributedOptimizer, StateDictMismatchError

from optim_common import assert_params_match, dp_setup, make_model, tp_setup, train, train_reference

ADAM = {"lr": 1e-2}
BEFORE, AFTER = 3, 4


def _optimizer(ddp):
    return DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs=ADAM, clip_grad=0.1)


def _save_at_dp2_tp2(folder: str) -> None:
    _, ddp, dp_rank, dp_size = tp_setup()
    opt = _optimizer(ddp)
    train(ddp, opt, BEFORE, dp_rank, dp_size)
    state = opt.state_dict(format="dcp")
    assert all(isinstance(v, DTensor) for e in state["state"].values() for k, v in e.items() if k != "step")
    dcp.save({"model": ddp.module.state_dict(), "optim": state}, checkpoint_id=folder)


def _resume(folder: str, setup) -> None:
    _, ddp, dp_rank, dp_size = setup(seed=7)  # other weights and a fresh optimizer: all must be replaced
    opt = _optimizer(ddp)
    state = {"model": ddp.module.state_dict(), "optim": opt.state_dict(format="dcp")}
    dcp.load(state, checkpoint_id=folder)
    ddp.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    train(ddp, opt, AFTER, dp_rank, dp_size, first_step=BEFORE)
    reference = make_model()
    train_reference(reference, torch.optim.Adam(reference.parameters(), **ADAM), BEFORE + AFTER, clip=0.1)
    assert_params_match(ddp.module, reference)


def _resume_at_dp4(folder: str) -> None:
    _resume(folder, lambda seed: (*dp_setup(seed), dist.get_rank(), 4))


@pytest.mark.parity
def test_format_dcp_saved_at_dp2_tp2_resumes_at_dp4_and_at_dp2_tp2(tmp_path):
    run_distributed(_save_at_dp2_tp2, 4, str(tmp_path), timeout=120)
    run_distributed(_resume_at_dp4, 4, str(tmp_path), timeout=120)
    run_distributed(_resume, 4, str(tmp_path), tp_setup, timeout=120)


def _refused(call) -> str:
    with pytest.raises(BaseException) as caught:  # torch's CheckpointException is a BaseException
        call()
    return str(caught.value)


@distributed(world_size=2, timeout=120)
def test_plain_dcp_of_state_dict_is_refused_on_every_rank_before_writing(tmp_path):
    _, ddp = dp_setup()
    opt = _optimizer(ddp)
    train(ddp, opt, 1, dist.get_rank(), 2)
    message = _refused(lambda: dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path))
    assert "dcp.save cannot save 'optim.state." in message and "state_dict(format='dcp')" in message
    assert "ndweave.checkpoint" in message
    assert not (tmp_path / ".metadata").exists()  # nothing was committed

    # a load into state_dict()'s ranges fails while DCP plans too (DCP drops values it does not know
    # before planning, so the message is its own: a key or kind it cannot match), changing nothing
    dcp.save({"optim": opt.state_dict(format="dcp")}, checkpoint_id=tmp_path)
    before = {k: v.data.clone() for k, v in opt.state_dict()["state"]["0.weight"].items() if k != "step"}
    assert "optim.state.0." in _refused(lambda: dcp.load({"optim": opt.state_dict()}, checkpoint_id=tmp_path))
    after = opt.state_dict()["state"]["0.weight"]
    assert all(torch.equal(after[k].data, v) for k, v in before.items())


@distributed(world_size=2, timeout=60)
def test_torch_get_and_set_state_dict_are_refused_naming_the_calls_that_work():
    """torch maps an optimizer's params to the model's by identity, and the master shards are none of
    them: refused on every rank (it was a bare KeyError) before torch steps a never-stepped optimizer
    to create its state, or reads anything."""
    _, ddp = dp_setup()
    opt = _optimizer(ddp)
    masters = [p.detach().clone() for p in opt.get_parameters()]
    for stepped in (False, True):
        for call in (lambda: get_state_dict(ddp, opt), lambda: get_state_dict(ddp.module, opt),
                     lambda: get_optimizer_state_dict(ddp, opt),
                     lambda: set_state_dict(ddp, opt, model_state_dict={}, optim_state_dict={"state": {}}),
                     lambda: set_optimizer_state_dict(ddp, opt, {"state": {}, "param_groups": []})):
            with pytest.raises(TypeError, match=r"cannot serve a DistributedOptimizer.*state_dict\(format='dcp'\)"):
                call()
        if not stepped:  # nothing was stepped to make state
            assert not opt.inner.state and all(torch.equal(m, p) for m, p in zip(masters, opt.get_parameters()))
            train(ddp, opt, 1, dist.get_rank(), 2)
    assert opt.state is opt.inner.state  # everyone else reads the state as before


@distributed(world_size=2, timeout=60)
def test_pieces_pickle_as_plain_state_pieces():
    _, ddp = dp_setup()
    opt = _optimizer(ddp)
    train(ddp, opt, 1, dist.get_rank(), 2)
    piece = opt.state_dict()["state"]["0.weight"]["exp_avg"]
    again = pickle.loads(pickle.dumps(piece))
    assert type(again) is StatePiece and again.fqn == "0.weight" and torch.equal(again.data, piece.data)


@distributed(world_size=2, timeout=60)
def test_format_dcp_of_a_never_stepped_optimizer_is_zeros_and_loads_back_unchanged():
    reference, ddp = dp_setup()
    opt = _optimizer(ddp)
    state = opt.state_dict(format="dcp")
    entry = state["state"]["0.weight"]
    assert set(entry) == {"exp_avg", "exp_avg_sq", "step"}  # fp32-or-wider model: masters are its params
    assert not entry["exp_avg"].any() and float(entry["step"]) == 0
    opt.load_state_dict(state)
    train(ddp, opt, 2, dist.get_rank(), 2)
    train_reference(reference, torch.optim.Adam(reference.parameters(), **ADAM), 2, clip=0.1)
    assert_params_match(ddp.module, reference)


@distributed(world_size=2, timeout=120)
def test_format_dcp_of_a_bf16_model_keeps_its_fp32_masters(tmp_path):
    _, ddp = dp_setup(dtype=torch.bfloat16)
    opt = _optimizer(ddp)
    train(ddp, opt, 2, dist.get_rank(), 2, dtype=torch.bfloat16)
    dcp.save({"optim": opt.state_dict(format="dcp")}, checkpoint_id=tmp_path)
    _, ddp2 = dp_setup(seed=7, dtype=torch.bfloat16)
    opt2 = _optimizer(ddp2)
    state = {"optim": opt2.state_dict(format="dcp")}
    assert state["optim"]["state"]["0.weight"]["master_param"].dtype == torch.float32
    dcp.load(state, checkpoint_id=tmp_path)
    opt2.load_state_dict(state["optim"])  # and the masters, rounded, into the model
    saved, loaded = opt.gather_full_state_dict()["state"], opt2.gather_full_state_dict()["state"]
    for fqn, entry in saved.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(loaded[fqn][key]), torch.as_tensor(value)), (fqn, key)
    for (name, p), q in zip(ddp2.module.named_parameters(), ddp.module.parameters()):
        assert torch.equal(p, q), name


@distributed(world_size=4, timeout=60)
def test_format_dcp_of_another_parameter_is_refused_naming_the_shapes():
    _, ddp, dp_rank, dp_size = tp_setup()
    opt = _optimizer(ddp)
    train(ddp, opt, 1, dp_rank, dp_size)
    state = opt.state_dict(format="dcp")
    state["state"]["0.weight"] = state["state"]["2.weight"]  # (16, 16) state for a (16, 8) parameter
    with pytest.raises(StateDictMismatchError, match=r"'0.weight': global shape \[16, 16\] in the state, \[16, 8\]"):
        opt.load_state_dict(state)


@distributed(world_size=2, timeout=60)
def test_unknown_format_is_refused():
    _, ddp = dp_setup()
    with pytest.raises(ValueError, match="format is 'pieces'"):
        _optimizer(ddp).state_dict(format="torch")


@pytest.mark.parity
def test_format_dcp_resumes_a_torch_optimizer_through_get_and_set_state_dict(tmp_path):
    """torch's own recipe on one process (no process group): get_state_dict of a plain Adam as the
    destination, dcp.load, set_state_dict; the run goes on as the uninterrupted one."""
    run_distributed(_save_at_dp2_tp2, 4, str(tmp_path), timeout=120)
    model = make_model(seed=7)
    adam = torch.optim.Adam(model.parameters(), lr=0.5)
    model_state, optim_state = get_state_dict(model, adam)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(model, adam, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert adam.param_groups[0]["lr"] == ADAM["lr"]
    train_reference(model, adam, AFTER, clip=0.1, first_step=BEFORE)
    reference = make_model()
    train_reference(reference, torch.optim.Adam(reference.parameters(), **ADAM), BEFORE + AFTER, clip=0.1)
    assert_params_match(model, reference)
