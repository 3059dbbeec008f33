"""The pipeline cells of the resharding matrix: nanoGPT (wte / lm_head tied, so the weight lives on the
first and the last stage) cut into 2 stages by FQN, DModule TP + DDP inside the stages, trained with
``PipeEngine`` and a ``DistributedOptimizer``. Saved at (PP, DP, TP) = (2, 1, 2) or (2, 2, 1) and
resumed at (1, 2, 2), (1, 4, 1), the other pipeline cell with the stage boundary moved, and on one
process without a process group (a plain ``torch.optim`` AdamW); saved at the PP-free cells and
resumed in both pipeline cells. Parameters, optimizer state, lr schedule and data position equal one
process's run at the save, and the next steps equal its continuation (float64, strict). The
checkpoint knows no stages: its keys are one device's FQNs, the tied weight's optimizer state is
there once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import test_integration_checkpoint as flat
from integration_models import build
from ndweave.checkpoint import DataPosition, load, save
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import assert_close, full_tensor, run_distributed
from ndweave.optim import BasicOptimizer, DistributedOptimizer, MASTER_KEY
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage

BEFORE, AFTER, BATCH = flat.BEFORE, flat.AFTER, flat.BATCH
# save cell (PP, DP, TP), its split point -> where it resumes: (cell, split point, ZeRO). Stage 0 is
# the embeddings (+ block 0 when split at h.1); the last stage holds lm_head, the tied copy.
SAVES = {
    (2, 1, 2): ("transformer.h.1", [((1, 2, 2), None, True), ((1, 4, 1), None, False),
                                    ((2, 2, 1), "transformer.h.0", False)]),
    (2, 2, 1): ("transformer.h.0", [((1, 2, 2), None, False), ((1, 4, 1), None, True),
                                    ((2, 1, 2), "transformer.h.1", True)]),
    # the PP-free cells' saves into pipelines (test_integration_checkpoint.py resumes them PP-free)
    (1, 2, 2): (None, [((2, 1, 2), "transformer.h.1", True), ((2, 2, 1), "transformer.h.0", False)]),
    (1, 4, 1): (None, [((2, 1, 2), "transformer.h.0", False), ((2, 2, 1), "transformer.h.1", True)]),
}


def _logits_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _layout(cell, split, zero, seed):
    """``(model, optimizer, scheduler, train)`` at ``cell``: DModule TP + DDP per stage chunk and
    ``PipeEngine`` where PP > 1, the plain loop otherwise; ``train(position, steps)``."""
    pp, dp, tp = cell
    if pp == 1:
        model, optimizer, scheduler, dp_rank = flat._parallel(dp, tp, zero, seed)

        def backward(x, y):
            flat._loss(model, x, y).backward()
    else:
        mesh = init_device_mesh("cpu", cell, mesh_dim_names=("PP", "DP", "TP"))
        plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=2, split_points=[split])
        model = construct_pipeline_stage(build("gpt", seed=seed), plan, mesh, example_inputs=flat.DATA[0][0][:2])
        for i in range(len(model)):
            chunk = model[i] if tp == 1 else parallelize_module(model[i], mesh["TP"], get_plan("nanogpt", model[i]))
            model[i] = DDP(chunk, mesh["DP"], use_distributed_optimizer=zero, bucket_size=500)
        backward = PipeEngine(model, mesh, _logits_loss, plan)  # before the optimizer (tied weights)
        kind = DistributedOptimizer if zero else BasicOptimizer
        optimizer = kind(torch.optim.AdamW, models=list(model.chunks), clip_grad=flat.CLIP,
                         optimizer_kwargs=flat.ADAMW)
        scheduler, dp_rank = flat._schedule(optimizer), mesh["DP"].get_local_rank()

    def train(position, steps):
        for _ in range(steps):
            x, y = flat.DATA[position.samples_seen // BATCH]
            part = position.rank_slice(BATCH, dp_rank, dp)
            part = slice(part.start - position.samples_seen, part.stop - position.samples_seen)
            optimizer.zero_grad()
            backward(x[part], y[part])
            optimizer.step()
            scheduler.step()
            position.advance(BATCH)

    return model, optimizer, scheduler, train


def _check_params(model, reference, layout):
    """This rank's parameters (a stage's: under both names of the tied weight) equal the reference's."""
    expected = dict(reference.named_parameters(remove_duplicate=False))
    named = dict(model.named_parameters(remove_duplicate=False))
    assert named
    for name, param in named.items():
        assert_close(param, expected[name], name=f"{layout}: {name}")


def _check_optimizer(optimizer, model, reference, ref_optimizer, layout):
    """The optimizer state this rank can see (all of it for a DistributedOptimizer, gathered over
    every stage; its own parameters' otherwise) equals the reference's, tied copies included."""
    expected = dict(reference.named_parameters(remove_duplicate=False))
    if isinstance(optimizer, DistributedOptimizer):
        full = optimizer.gather_full_state_dict()["state"]
        assert set(dict(reference.named_parameters())) <= set(full)
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        full = {names[id(p)]: {k: full_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for p, s in optimizer.state.items()}
        assert set(full) == set(names.values())
    for name, entry in full.items():
        ref = ref_optimizer.state[expected[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(entry[key], ref[key], name=f"{layout}: {name} {key}")
        assert float(entry["step"]) == float(ref["step"])
        if MASTER_KEY in entry:
            assert_close(entry[MASTER_KEY], expected[name], name=f"{layout}: {name} master")
    assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"]


def _save_and_resume(folder, cell):
    """Save at ``cell`` (async, training one more step while the files are written), then resume at
    each layout of ``SAVES[cell]``, all in one pool."""
    torch.set_default_dtype(torch.float64)
    split, loads = SAVES[cell]
    model, optimizer, scheduler, train = _layout(cell, split, True, seed=0)
    position = DataPosition()
    train(position, BEFORE)
    state = flat._state(model, optimizer, scheduler, position)
    state["step"] = BEFORE
    handle = save(f"{folder}/ckpt", state, async_checkpoint=True)
    train(position, 1)
    handle.wait()

    at_save, ref_optimizer, ref_scheduler = flat._reference(BEFORE)
    after, _, _ = flat._reference(BEFORE + AFTER)
    for load_cell, load_split, zero in loads:
        layout = f"saved at (PP, DP, TP) = {cell}, loaded at {load_cell} split at {load_split}, ZeRO {zero}"
        model, optimizer, scheduler, train = _layout(load_cell, load_split, zero, seed=1)  # other weights
        position = DataPosition()
        state = flat._state(model, optimizer, scheduler, position)
        load(f"{folder}/ckpt", state)
        assert state["step"] == BEFORE and position.samples_seen == BEFORE * BATCH
        assert scheduler.state_dict() == ref_scheduler.state_dict()
        _check_params(model, at_save, layout)
        _check_optimizer(optimizer, model, at_save, ref_optimizer, layout)
        train(position, AFTER)
        _check_params(model, after, layout)
        dist.barrier()


@pytest.mark.parity
@pytest.mark.parametrize("cell", list(SAVES), ids=lambda c: "pp{}_dp{}_tp{}".format(*c))
def test_pipeline_checkpoint_resumes_at_every_layout_and_on_one_process(tmp_path, cell):
    torch.set_default_dtype(torch.float64)
    try:
        run_distributed(_save_and_resume, 4, str(tmp_path), cell, timeout=300)
        plain = flat.resume_on_one_process(tmp_path)
        # keyed by one device's FQNs: the model's state dict as torch has it (both names of the tied
        # weight), the optimizer's state once per parameter, param groups listing every stage's
        one_device = build("gpt")
        assert set(plain["model"]) == set(one_device.state_dict())
        names = [n for n, _ in one_device.named_parameters()]
        assert set(plain["optimizer"]["state"]) == set(names)
        assert sorted(plain["optimizer"]["param_groups"][0]["params"]) == sorted(names)
    finally:
        torch.set_default_dtype(torch.float32)
