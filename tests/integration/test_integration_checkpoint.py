"""The resharding matrix: nanoGPT (tied embeddings) trained with DModule TP + DDP + an ndweave
optimizer, saved with ``ndweave.checkpoint`` at (DP, TP) = (2, 2) or (4, 1), ZeRO on or off, and
resumed at every other cell and on one process without a process group (a plain ``torch.optim``
AdamW): parameters, optimizer state, lr schedule and data position equal one process's run at the
moment of the save, and the next steps equal its uninterrupted continuation. Float64, strict.
Plus HF GPT-2, whose fused q|k|v weight is ``StridedShard``: its sharded optimizer state (flat
ranges of strided shards) saved at DP=2 x TP=2 resumes on one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import test_integration_gpt2_optimizer_state as gpt2
from integration_models import batches, build
from ndweave.checkpoint import DataPosition, load, save
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import assert_close, full_tensor, run_distributed, train_one_process
from ndweave.optim import BasicOptimizer, DistributedOptimizer, MASTER_KEY

BEFORE, AFTER, BATCH = 3, 5, 8
CLIP = 0.5
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
CELLS = [(2, 2, True), (2, 2, False), (4, 1, True), (4, 1, False)]  # (DP, TP, ZeRO)
DATA = batches("gpt", BEFORE + AFTER, BATCH)


def _loss(model, x, y):
    logits, _ = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _schedule(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _train(model, optimizer, scheduler, position, steps, dp_rank=0, dp_size=1, clip=None):
    for _ in range(steps):
        x, y = DATA[position.samples_seen // BATCH]
        part = position.rank_slice(BATCH, dp_rank, dp_size)
        part = slice(part.start - position.samples_seen, part.stop - position.samples_seen)
        optimizer.zero_grad()
        _loss(model, x[part], y[part]).backward()
        if clip:  # the ndweave optimizers clip to the global norm themselves
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        position.advance(BATCH)


def _reference(steps):
    """One process, plain AdamW: the run every resumed one must equal. Its optimizer and scheduler
    are built here and returned, for the state checks."""
    model = build("gpt", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    scheduler = _schedule(optimizer)
    train_one_process(model, DATA[:steps], optimizer=optimizer, model_loss=_loss, clip=CLIP, scheduler=scheduler)
    return model, optimizer, scheduler


def _gpt2_loss(model, ids, _):
    """``gpt2._train``'s loss: the next token of ``ids`` itself."""
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, gpt2.VOCAB), ids[:, 1:].reshape(-1))


def _gpt2_reference(reference, optimizer, batches):
    train_one_process(reference, [(ids, ids) for ids in batches], optimizer=optimizer, model_loss=_gpt2_loss)


def _parallel(dp, tp, zero, seed):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("DP", "TP"))
    model = build("gpt", seed=seed)
    if tp > 1:
        model = parallelize_module(model, mesh["TP"], get_plan("nanogpt", model))
    model = DDP(model, mesh["DP"], use_distributed_optimizer=zero, bucket_size=500)
    kind = DistributedOptimizer if zero else BasicOptimizer
    optimizer = kind(torch.optim.AdamW, models=[model], clip_grad=CLIP, optimizer_kwargs=ADAMW)
    scheduler = _schedule(optimizer)
    return model, optimizer, scheduler, mesh.get_data_parallel_rank()


def _state(model, optimizer, scheduler, position):
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": position, "step": 0}


def _check_optimizer(optimizer, model, reference, ref_optimizer, layout):
    """The full optimizer state equals the reference's (any ndweave optimizer, or a torch one)."""
    if isinstance(optimizer, DistributedOptimizer):
        full = optimizer.gather_full_state_dict()["state"]
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        full = {names[id(p)]: {k: full_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for p, s in optimizer.state.items()}
    for name, p in reference.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(full[name][key], ref_optimizer.state[p][key], name=f"{layout}: {name} {key}")
        assert float(full[name]["step"]) == float(ref_optimizer.state[p]["step"])
        if MASTER_KEY in full[name]:
            assert_close(full[name][MASTER_KEY], p, name=f"{layout}: {name} master")
    assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"]


def _check_params(model, reference, layout):
    params = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert_close(params[name], p, name=f"{layout}: {name}")


def _save_at(folder, dp, tp, zero):
    torch.set_default_dtype(torch.float64)
    model, optimizer, scheduler, dp_rank = _parallel(dp, tp, zero, seed=0)
    position = DataPosition()
    _train(model, optimizer, scheduler, position, BEFORE, dp_rank, dp)
    state = _state(model, optimizer, scheduler, position)
    state["step"] = BEFORE
    handle = save(f"{folder}/ckpt", state, async_checkpoint=zero)  # async for the ZeRO cells
    _train(model, optimizer, scheduler, position, 1, dp_rank, dp)  # training goes on while it writes
    handle.wait()


def _load_at_every_cell(folder):
    torch.set_default_dtype(torch.float64)
    at_save, ref_optimizer, ref_scheduler = _reference(BEFORE)
    after, _, _ = _reference(BEFORE + AFTER)
    for dp, tp, zero in CELLS:
        layout = f"DP={dp} x TP={tp}, ZeRO {'on' if zero else 'off'}"
        model, optimizer, scheduler, dp_rank = _parallel(dp, tp, zero, seed=1)  # other weights: all must be replaced
        position = DataPosition()
        state = _state(model, optimizer, scheduler, position)
        load(f"{folder}/ckpt", state)
        assert state["step"] == BEFORE and position.samples_seen == BEFORE * BATCH
        assert scheduler.state_dict() == ref_scheduler.state_dict()
        _check_params(model, at_save, layout)
        _check_optimizer(optimizer, model, at_save, ref_optimizer, layout)
        _train(model, optimizer, scheduler, position, AFTER, dp_rank, dp)
        _check_params(model, after, layout)
        dist.barrier()


@pytest.mark.parity
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"dp{c[0]}_tp{c[1]}_{'zero' if c[2] else 'basic'}")
def test_resume_at_every_layout_and_on_one_process(tmp_path, cell):
    torch.set_default_dtype(torch.float64)
    try:
        run_distributed(_save_at, 4, str(tmp_path), *cell, timeout=300)
        run_distributed(_load_at_every_cell, 4, str(tmp_path), timeout=300)
        resume_on_one_process(tmp_path)
    finally:
        torch.set_default_dtype(torch.float32)


def resume_on_one_process(folder) -> dict:
    """Load ``folder/ckpt`` on one process, no process group, into a plain torch AdamW (from any
    layout's state) and check it against the reference, at the save and AFTER steps later; and read it
    with plain DCP (``dcp_to_torch_save`` + a single-device model). Returns the plain file's dict."""
    at_save, ref_optimizer, ref_scheduler = _reference(BEFORE)
    after, _, _ = _reference(BEFORE + AFTER)
    model = build("gpt", seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    scheduler, position = _schedule(optimizer), DataPosition()
    state = _state(model, optimizer, scheduler, position)
    load(folder / "ckpt", state)
    assert state["step"] == BEFORE and scheduler.state_dict() == ref_scheduler.state_dict()
    _check_params(model, at_save, "one process")
    _check_optimizer(optimizer, model, at_save, ref_optimizer, "one process")
    _train(model, optimizer, scheduler, position, AFTER, clip=CLIP)
    _check_params(model, after, "one process")

    dcp_to_torch_save(folder / "ckpt", folder / "plain.pt")
    plain_state = torch.load(folder / "plain.pt", weights_only=False)
    plain = build("gpt", seed=1)
    plain.load_state_dict(plain_state["model"])
    _check_params(plain, at_save, "dcp_to_torch_save")
    return plain_state


def _save_gpt2(folder):
    torch.set_default_dtype(torch.float64)
    model, optimizer, dp_rank = gpt2._parallel(seed=0, dp=2, tp=2)
    gpt2._train(model, optimizer, gpt2._batches(0, gpt2.STEPS), dp_rank, 2)
    save(f"{folder}/gpt2", {"model": model, "optimizer": optimizer})


@pytest.mark.parity
def test_gpt2_fused_qkv_sharded_state_resumes_on_one_process(tmp_path):
    pytest.importorskip("transformers")
    run_distributed(_save_gpt2, 4, str(tmp_path), timeout=300)
    torch.set_default_dtype(torch.float64)
    try:
        reference = gpt2._gpt2(seed=0)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), **gpt2.ADAMW)
        _gpt2_reference(reference, ref_optimizer, gpt2._batches(0, gpt2.STEPS))
        model = gpt2._gpt2(seed=1)
        optimizer = torch.optim.AdamW(model.parameters(), **gpt2.ADAMW)
        load(tmp_path / "gpt2", {"model": model, "optimizer": optimizer})
        _check_params(model, reference, "GPT-2 on one process")
        _check_optimizer(optimizer, model, reference, ref_optimizer, "GPT-2 on one process")
        more = gpt2._batches(gpt2.STEPS, gpt2.MORE_STEPS)
        _gpt2_reference(reference, ref_optimizer, more)
        gpt2._train(model, optimizer, more)
        _check_params(model, reference, "GPT-2 on one process, resumed")
    finally:
        torch.set_default_dtype(torch.float32)
