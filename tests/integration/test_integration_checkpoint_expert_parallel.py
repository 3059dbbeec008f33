"""Expert-parallel checkpoints reshard: a MoE model trained at DP=2 x EP=2 (ZeRO) and saved with
``ndweave.checkpoint`` loads at EP=4 (no ZeRO), trains on and is saved again; that checkpoint loads
on one process, without a process group, into the plain model and a plain ``torch.optim.AdamW``.
Each phase's losses and parameters equal one process's uninterrupted run, in float64 (strict). The
experts are saved as their global ``(E, ...)`` tensors under their FQNs, as the plain model has them.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from moe_models import ADAMW, ROWS, TinyMoE, build_hf_moe, lm_batch, lm_loss, parallel_moe, tiny_batch, tiny_loss
from ndweave.checkpoint import load, save
from ndweave.dmodule import get_plan
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, run_distributed, train_one_process

CLIP = 0.5
WORLD = 4
BATCH = WORLD * ROWS  # the global batch, whatever the layout
PHASES = (3, 2, 2)  # steps at DP=2 x EP=2, then at EP=4, then on one process
TINY = (TinyMoE, {"patch": {"experts": ["expert_parallel"]}}, tiny_batch, tiny_loss)


def _reference(build, make_batch, loss_of):
    """One process, plain AdamW over the global batch: every step's loss and the parameters at the
    end of each phase."""
    torch.manual_seed(0)
    model = build()
    ends = {sum(PHASES[:phase + 1]) - 1 for phase in range(len(PHASES))}  # each phase's last step
    params = []

    def at_phase_end(step, model):
        if step in ends:
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})

    run = train_one_process(model, [make_batch(step, BATCH) for step in range(sum(PHASES))],
                            optimizer=lambda ps: torch.optim.AdamW(ps, **ADAMW),
                            model_loss=lambda model, x, y: loss_of(model, (x, y)), clip=CLIP, on_step=at_phase_end)
    return [torch.tensor(loss, dtype=STRICT_DTYPE) for loss in run.losses], params


def _step(model, optimizer, loss_of, batch, clip=None) -> float:
    optimizer.zero_grad()
    loss = loss_of(model, batch)
    loss.backward()
    if clip:  # the ndweave optimizers clip to the global norm themselves
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach()


def _train_parallel(folder, phase, load_from, save_to, dp, ep, zero, build, plan, make_batch, loss_of, ref):
    """On every rank: a model at (dp, ep), loaded from ``load_from`` (unless None), trained for
    ``PHASES[phase]`` steps and saved to ``save_to``."""
    torch.set_default_dtype(STRICT_DTYPE)
    first, steps = sum(PHASES[:phase]), PHASES[phase]
    ref_losses, ref_params = ref
    torch.manual_seed(0 if load_from is None else 1 + ep)  # loading: other weights, which the load must replace
    model, optimizer = parallel_moe(build(), plan, dp=dp, ep=ep, zero=zero, clip=CLIP)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load_from:
        load(f"{folder}/{load_from}", state)
        assert state["step"] == first
    rank, mine = dist.get_rank(), slice(dist.get_rank() * ROWS, (dist.get_rank() + 1) * ROWS)
    for step in range(first, first + steps):
        loss = _step(model, optimizer, loss_of, tuple(t[mine] for t in make_batch(step, BATCH)))
        dist.all_reduce(loss)
        assert_close(loss / WORLD, ref_losses[step], name=f"DP={dp} x EP={ep}: step {step} loss (rank {rank})")
    params = dict(model.named_parameters())
    for fqn, expected in ref_params[phase].items():
        assert_close(params[fqn], expected, name=f"DP={dp} x EP={ep}: {fqn} after step {first + steps - 1}")
    save(f"{folder}/{save_to}", {**state, "step": first + steps})


def _check_reshard(folder, build, plan, make_batch, loss_of) -> None:
    torch.set_default_dtype(STRICT_DTYPE)
    try:
        ref = _reference(build, make_batch, loss_of)
        common = (build, plan, make_batch, loss_of, ref)
        run_distributed(_train_parallel, WORLD, folder, 0, None, "ep2", 2, 2, True, *common, timeout=300)
        run_distributed(_train_parallel, WORLD, folder, 1, "ep2", "ep4", 1, 4, False, *common, timeout=300)
        # the experts on disk: one global tensor per FQN, as the plain model names and shapes them
        torch.manual_seed(2)
        plain = build()
        stored = FileSystemReader(f"{folder}/ep4").read_metadata().state_dict_metadata
        for fqn, p in plain.named_parameters():
            assert tuple(stored[f"model.{fqn}"].size) == tuple(p.shape), fqn
        optimizer = torch.optim.AdamW(plain.parameters(), **ADAMW)
        state = {"model": plain, "optimizer": optimizer, "step": 0}
        load(f"{folder}/ep4", state)  # one process, no process group
        first = PHASES[0] + PHASES[1]
        assert state["step"] == first
        for step in range(first, first + PHASES[2]):
            loss = _step(plain, optimizer, loss_of, make_batch(step, BATCH), clip=CLIP)
            assert_close(loss, ref[0][step], name=f"one process: step {step} loss")
        for fqn, p in plain.named_parameters():
            assert_close(p, ref[1][2][fqn], name=f"one process: {fqn} at the end")
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parity
def test_tiny_moe_resumes_from_ep2_at_ep4_and_on_one_process(tmp_path):
    _check_reshard(str(tmp_path), *TINY)


@pytest.mark.heavy
@pytest.mark.parity
def test_hf_mixtral_resumes_from_ep2_at_ep4_and_on_one_process_in_the_plain_hf_model(tmp_path):
    pytest.importorskip("transformers")
    build = functools.partial(build_hf_moe, "hf_mixtral")
    _check_reshard(str(tmp_path), build, get_plan("hf_mixtral", build(), expert_parallel=True), lm_batch, lm_loss)
