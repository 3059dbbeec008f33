"""torch's own checkpoint APIs with ndweave's ``DistributedOptimizer`` (issue #27), on nanoGPT (tied
embeddings) with DModule TP + DDP + ZeRO, float64, strict:

* saved at DP=2 x TP=2 with plain ``dcp.save`` of ``get_model_state_dict(model)`` and
  ``optimizer.state_dict(format="dcp")``, resumed with plain ``dcp.load`` at DP=2 x TP=2 and DP=4, on
  one process into a plain ``torch.optim.AdamW`` through torch's ``get_state_dict`` /
  ``set_state_dict``, and by ``ndweave.checkpoint.load``: parameters and optimizer state at the save
  and the next steps equal one process's uninterrupted run; that plain AdamW's own checkpoint
  (``get_state_dict``) reads back into DP=2 x TP=2 the same way;
* a checkpoint ``ndweave.checkpoint.save`` wrote reads the same way with plain ``dcp.load``;
* what is refused, on every rank, before anything is written or loaded: ``dcp.save`` of
  ``optimizer.state_dict()`` (this rank's ranges), torch's ``get_state_dict`` / ``set_state_dict``
  with the optimizer itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from integration_models import build
from ndweave.checkpoint import DataPosition, load, save
from ndweave.mesh.testing import run_distributed
from test_integration_checkpoint import (
    ADAMW,
    AFTER,
    BATCH,
    BEFORE,
    CLIP,
    _check_optimizer,
    _check_params,
    _parallel,
    _reference,
    _schedule,
    _train,
)


def _torch_state(model, optimizer, scheduler) -> dict:
    """What a torch user hands DCP: the model as torch's get_model_state_dict gives it, the optimizer
    in its DCP form, the schedule."""
    return {"model": get_model_state_dict(model), "optim": optimizer.state_dict(format="dcp"),
            "scheduler": scheduler.state_dict()}


def _save_with_dcp(folder: str, writer: str) -> None:
    torch.set_default_dtype(torch.float64)
    model, optimizer, scheduler, dp_rank = _parallel(2, 2, True, seed=0)
    _train(model, optimizer, scheduler, DataPosition(), BEFORE, dp_rank, 2)
    if writer == "torch":
        dcp.save(_torch_state(model, optimizer, scheduler), checkpoint_id=folder)
    else:
        save(folder, {"model": model, "optim": optimizer, "scheduler": scheduler})


def _resume_with_dcp(folder: str) -> None:
    """Plain dcp.load at DP=2 x TP=2 and at DP=4, into freshly built models and optimizers."""
    torch.set_default_dtype(torch.float64)
    at_save, ref_optimizer, ref_scheduler = _reference(BEFORE)
    after, _, _ = _reference(BEFORE + AFTER)
    for dp, tp in ((2, 2), (4, 1)):
        layout = f"dcp.load at DP={dp} x TP={tp}"
        model, optimizer, scheduler, dp_rank = _parallel(dp, tp, True, seed=1)  # other weights, never stepped
        state = _torch_state(model, optimizer, scheduler)
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(model, state["model"])
        optimizer.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        _check_params(model, at_save, layout)
        _check_optimizer(optimizer, model, at_save, ref_optimizer, layout)
        position = DataPosition(samples_seen=BEFORE * BATCH)
        _train(model, optimizer, scheduler, position, AFTER, dp_rank, dp)
        _check_params(model, after, layout)
        dist.barrier()


def _resume_with_ndweave(folder: str) -> None:
    torch.set_default_dtype(torch.float64)
    at_save, ref_optimizer, _ = _reference(BEFORE)
    model, optimizer, scheduler, _ = _parallel(4, 1, True, seed=1)
    load(folder, {"model": model, "optim": optimizer, "scheduler": scheduler})
    _check_params(model, at_save, "ndweave.checkpoint.load at DP=4")
    _check_optimizer(optimizer, model, at_save, ref_optimizer, "ndweave.checkpoint.load at DP=4")


def _resume_on_one_process(folder) -> None:
    """torch's recipe, one process, no process group: get_state_dict of a plain AdamW as the
    destination, dcp.load, set_state_dict."""
    at_save, ref_optimizer, ref_scheduler = _reference(BEFORE)
    after, _, _ = _reference(BEFORE + AFTER)
    model = build("gpt", seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    scheduler = _schedule(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    assert scheduler.state_dict() == ref_scheduler.state_dict()
    _check_params(model, at_save, "one process")
    _check_optimizer(optimizer, model, at_save, ref_optimizer, "one process")
    _train(model, optimizer, scheduler, DataPosition(samples_seen=BEFORE * BATCH), AFTER, clip=CLIP)
    _check_params(model, after, "one process")
    model_state, optim_state = get_state_dict(model, optimizer)  # and torch's own checkpoint of it
    dcp.save({"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()},
             checkpoint_id=f"{folder}-torch-adamw")


def _resume_torch_adamw_checkpoint(folder: str) -> None:
    """A plain AdamW's checkpoint (torch's get_state_dict) read back into DP=2 x TP=2 with ZeRO."""
    torch.set_default_dtype(torch.float64)
    after, ref_optimizer, ref_scheduler = _reference(BEFORE + AFTER)
    model, optimizer, scheduler, _ = _parallel(2, 2, True, seed=1)
    state = _torch_state(model, optimizer, scheduler)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    optimizer.load_state_dict(state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    assert scheduler.state_dict() == ref_scheduler.state_dict()
    _check_params(model, after, "a torch AdamW checkpoint at DP=2 x TP=2")
    _check_optimizer(optimizer, model, after, ref_optimizer, "a torch AdamW checkpoint at DP=2 x TP=2")


@pytest.mark.parity
@pytest.mark.heavy
def test_saved_with_torch_dcp_resumes_at_other_layouts_on_one_process_and_with_ndweave(tmp_path):
    folder = str(tmp_path / "torch")
    torch.set_default_dtype(torch.float64)
    try:
        run_distributed(_save_with_dcp, 4, folder, "torch", timeout=300)
        run_distributed(_resume_with_dcp, 4, folder, timeout=300)
        run_distributed(_resume_with_ndweave, 4, folder, timeout=300)
        _resume_on_one_process(folder)
        run_distributed(_resume_torch_adamw_checkpoint, 4, f"{folder}-torch-adamw", timeout=300)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parity
def test_saved_with_ndweave_checkpoint_resumes_with_plain_dcp_load(tmp_path):
    folder = str(tmp_path / "ndweave")
    run_distributed(_save_with_dcp, 4, folder, "ndweave", timeout=300)
    run_distributed(_resume_with_dcp, 4, folder, timeout=300)


def _refused(call) -> str:
    with pytest.raises(BaseException) as caught:  # torch's CheckpointException is a BaseException
        call()
    return f"{type(caught.value).__name__}: {caught.value}"


def _torch_calls_refused(folder: str) -> None:
    torch.set_default_dtype(torch.float64)
    model, optimizer, scheduler, dp_rank = _parallel(2, 2, True, seed=0)
    _train(model, optimizer, scheduler, DataPosition(), 1, dp_rank, 2)
    before = optimizer.gather_full_state_dict()

    message = _refused(lambda: dcp.save({"optim": optimizer.state_dict()}, checkpoint_id=folder))
    assert "dcp.save cannot save 'optim.state." in message and "state_dict(format='dcp')" in message, message
    assert not (folder / ".metadata").exists()

    # torch's get_state_dict / set_state_dict map an optimizer's params to the model's by identity:
    # the 1-D master shards DistributedOptimizer steps are none of them. Refused with the calls that
    # work (it was a bare KeyError), before anything is read or stepped
    for wrapped in (model, model.module):
        message = _refused(lambda: get_state_dict(wrapped, optimizer))
        assert message.startswith("TypeError") and "state_dict(format='dcp')" in message, message
    torch_like = {"state": before["state"], "param_groups": before["param_groups"]}  # FQN-keyed, as torch's
    message = _refused(lambda: set_state_dict(model, optimizer, model_state_dict={}, optim_state_dict=torch_like))
    assert message.startswith("TypeError") and "ndweave.checkpoint.save / load" in message, message
    after = optimizer.gather_full_state_dict()
    for fqn, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(after["state"][fqn][key]), torch.as_tensor(value)), (fqn, key)


def test_torch_calls_it_cannot_serve_are_refused_before_anything_is_written(tmp_path):
    run_distributed(_torch_calls_refused, 4, tmp_path, timeout=300)
