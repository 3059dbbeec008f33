"""ZeRO-2 (``DDP(..., zero_stage=2)`` + ``DistributedOptimizer``): each rank keeps 1/DP of the grads.

Checked against one process (float64, strict) with clipping and micro-batches, on DP x TP with
sequence parallelism (``Partial`` grads reduced on the shards) and on DP=4; its state dict equals
ZeRO-1's and loads into ZeRO-1 and back; its peak memory per rank is what the theory says
(params 4Ψ + grads 4Ψ/N + Adam 8Ψ/N for fp32, plus the full-size buckets in flight).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from integration_models import batches, build, loss_of
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.ddp.grad_shard import MAX_IN_FLIGHT
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed, train_one_process
from ndweave.mesh.testing.memory import TensorMemory
from ndweave.optim import DistributedOptimizer

STEPS, BATCH = 12, 8
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def _reference(reference, data, micro_batches: int, clip: float):
    train_one_process(reference, data, optimizer=lambda ps: torch.optim.AdamW(ps, **ADAMW), micro_batches=micro_batches,
                      model_loss=lambda m, x, y: loss_of(m(x, y)), clip=clip)
    return dict(reference.named_parameters())


def _wrap(kind: str, model, zero_stage: int, overlap: bool = False):
    if DEVICE_MESH.get_strategy_size("TP") > 1:
        model = parallelize_module(model, DEVICE_MESH["TP"], get_plan("nanogpt", model, sequence_parallel=True))
    model = DDP(model, DEVICE_MESH["DP"], zero_stage=zero_stage, bucket_size=500)
    opt = DistributedOptimizer(torch.optim.AdamW, [model], optimizer_kwargs=ADAMW, clip_grad=0.5,
                               overlap_param_gather=overlap)
    return model, opt


def _train(model, opt, data, micro_batches: int) -> None:
    dp_rank, dp_size = DEVICE_MESH.get_data_parallel_rank(), DEVICE_MESH.get_strategy_size("DP")
    for x, y in data:
        opt.zero_grad()
        xs, ys = x.chunk(dp_size)[dp_rank].chunk(micro_batches), y.chunk(dp_size)[dp_rank].chunk(micro_batches)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with model.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
                (loss_of(model(xm, ym)) / micro_batches).backward()
        opt.step()
    opt.wait_param_gather()


@pytest.mark.parity
@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("layout", ["dp2_tp2_sp", "dp4"])
@distributed(world_size=4, timeout=300)
def test_zero2_trains_like_one_process_with_clipping_and_micro_batches(layout, micro_batches):
    """nanoGPT (dp2_tp2_sp: sequence parallel, so some grads are Partial over TP and are reduced on the
    grad shards) or the MLP over DP=4 with overlapped param gathers; AdamW, clip 0.5."""
    tp = 2 if layout == "dp2_tp2_sp" else 1
    DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(4 // tp, tp), mesh_dim_names=("DP", "TP"))
    torch.set_default_dtype(STRICT_DTYPE)
    kind = "nanogpt" if tp > 1 else "mlp"
    reference = build(kind)
    model, opt = _wrap(kind, copy.deepcopy(reference), zero_stage=2, overlap=tp == 1)
    data = batches("gpt" if tp > 1 else "mlp", STEPS, BATCH)
    _train(model, opt, data, micro_batches)
    expected = _reference(reference, data, micro_batches, clip=0.5)
    for name, p in model.named_parameters():
        assert_close(p, expected[name], name=name)


def _layout(state_dict) -> dict:
    """Each entry's type and, for a piece, which range of which tensor it holds (not the values)."""
    return {fqn: {k: (type(v).__name__, getattr(v, "start", None), getattr(v, "end", None), getattr(v, "layout", None))
                  for k, v in entry.items()} for fqn, entry in state_dict["state"].items()}


@pytest.mark.parity
@distributed(world_size=4, timeout=300)
def test_zero2_state_dict_is_zero1s_and_loads_into_zero1_and_back():
    DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(4, 1), mesh_dim_names=("DP", "TP"))
    torch.set_default_dtype(STRICT_DTYPE)
    reference = build("mlp")
    data = batches("mlp", 2 * STEPS, BATCH)
    runs = {stage: _wrap("mlp", copy.deepcopy(reference), stage) for stage in (1, 2)}
    for model, opt in runs.values():
        _train(model, opt, data[:STEPS], 1)
    states = {stage: opt.state_dict() for stage, (_, opt) in runs.items()}
    assert _layout(states[1]) == _layout(states[2]), "ZeRO-2 writes another state dict than ZeRO-1"
    assert states[1]["param_groups"] == states[2]["param_groups"]
    full = {stage: opt.gather_full_state_dict() for stage, (_, opt) in runs.items()}
    for fqn, entry in full[1]["state"].items():
        assert entry.keys() == full[2]["state"][fqn].keys()
        for key, value in entry.items():
            if value.dtype == STRICT_DTYPE:
                assert_close(full[2]["state"][fqn][key], value, name=f"{fqn} {key}")
            else:  # Adam's step count
                assert torch.equal(full[2]["state"][fqn][key], value), f"{fqn} {key}"
    expected = _reference(reference, data, 1, clip=0.5)
    for saved, loaded in ((2, 1), (1, 2)):  # each stage's checkpoint resumed by the other
        model, opt = _wrap("mlp", build("mlp"), loaded)
        model.load_state_dict(runs[saved][0].state_dict())
        opt.load_state_dict(states[saved])
        _train(model, opt, data[STEPS:], 1)
        for name, p in model.named_parameters():
            assert_close(p, expected[name], name=f"{name}, ZeRO-{saved} state resumed at ZeRO-{loaded}")


class _Deep(torch.nn.Module):
    """fp32 MLP of 16 x Linear(128, 128): Ψ = 264,192 params (1 MiB), one layer per bucket, 4 rows."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(16)])

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layers(x), y)


def peak_and_theory(zero_stage: int) -> tuple[int, dict[str, int]]:
    """This rank's peak bytes over two steps (model, buffers and optimizer state included) and the
    theory's terms for it."""
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 128, generator=g), torch.randn(4, 128, generator=g)
    with TensorMemory() as memory:
        torch.manual_seed(0)
        model = DDP(_Deep(), DEVICE_MESH["DP"], zero_stage=zero_stage, bucket_size=128 * 129)
        opt = DistributedOptimizer(torch.optim.AdamW, [model], optimizer_kwargs=ADAMW, clip_grad=1.0)
        for step in range(3):
            if step == 1:  # the steps alone (Adam's state exists now; wrapping briefly held the params twice)
                memory.reset_peak()
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
    bucket = max(b.numel for b in model.grad_buckets()) * 4
    params = sum(b.numel for b in model.grad_buckets()) * 4  # 4Ψ, and the buckets' padding
    theory = {"params": params, "grads": params // n if zero_stage == 2 else params,
              "adam": opt.optimizer_state_bytes(), "masters": opt.master_param_bytes(),
              # (no copies: DDP all-reduces in place on gloo, NCCL reduce-scatters in place)
              "buckets": (MAX_IN_FLIGHT + 1) * bucket if zero_stage == 2 else 0}
    return memory.peak_bytes("cpu"), theory


GLOO_WORKER_THREADS = 2  # ProcessGroupGloo's default


@distributed(world_size=4, timeout=300)
def test_zero2_peak_memory_per_rank_is_the_theory():
    """fp32, DP=4, AdamW (masters are the fp32 model's own param_data): ZeRO-2's peak is params 4Ψ +
    grads 4Ψ/N + Adam 8Ψ/N + the buckets in flight, ZeRO-1's has 4Ψ of grads, each within the
    activations of 4 rows (measured at 5% of 4Ψ)."""
    DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(4,), mesh_dim_names=("DP",))
    torch.set_default_dtype(torch.float32)  # (the ranks are reused: another test may have left float64)
    psi = sum(p.numel() for p in _Deep().parameters())
    peaks = {}
    for stage in (1, 2):
        peak, theory = peak_and_theory(stage)
        # 8Ψ/N: the last rank owns a little less (each bucket pads at its end)
        assert theory["adam"] == pytest.approx(8 * psi / 4, rel=0.05) and theory["masters"] == 0
        steady = theory["params"] + theory["grads"] + theory["adam"]
        # a reduced bucket's buffer lives on until gloo's worker thread drops its finished work, just
        # after wait() returns: up to one more bucket per worker thread (2 per group), timing-dependent.
        # Without this, 4 of 7 runs read 0.13-0.15 MiB over the buckets in flight; with a 3 ms pause
        # after each wait (the thread done by then), 5 of 5 stayed within. A pool of buffers would bound it.
        held = GLOO_WORKER_THREADS * theory["buckets"] // (MAX_IN_FLIGHT + 1) if stage == 2 else 0
        bound = sum(theory.values()) + held + 0.1 * theory["params"]
        assert steady <= peak <= bound, (
            f"ZeRO-{stage}: peak {peak / 2**20:.3f} MiB against the theory {bound / 2**20:.3f} MiB "
            f"({ {k: round(v / 2**20, 3) for k, v in theory.items()} } + activations)")
        peaks[stage] = peak
    # theory: (4Ψ + 4Ψ/4 + 8Ψ/4 + 3 of 16 layers' buckets) / (4Ψ + 4Ψ + 8Ψ/4) = 1.94 / 2.5 = 0.78
    assert peaks[2] < 0.82 * peaks[1], f"ZeRO-2's peak {peaks[2]} is not well below ZeRO-1's {peaks[1]}"
