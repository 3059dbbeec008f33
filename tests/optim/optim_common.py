"""Models, data and single-device references shared by the ``ndweave.optim`` tests.

Everything defaults to float64 (strict parity, :data:`ndweave.mesh.testing.STRICT`); the bf16 tests
pass their dtype and measure their bound (:func:`ndweave.mesh.testing.measured_tolerance`)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ndweave.mesh.testing import STRICT_DTYPE, ReferenceDataParallel, Tolerance, assert_close, train_one_process, train_one_process

IN, HIDDEN, OUT = 8, 16, 4
GLOBAL_BATCH = 16


def make_model(seed: int = 0, dtype: torch.dtype = STRICT_DTYPE) -> nn.Sequential:
    """Linear(8,16) - Tanh - Linear(16,16) - Tanh - Linear(16,4): 484 params, several buckets."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    return model.to(dtype)


def batch(step: int, dtype: torch.dtype = STRICT_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (identical on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def local_batch(step: int, dp_rank: int, dp_size: int, dtype: torch.dtype = STRICT_DTYPE):
    x, y = batch(step, dtype)
    n = GLOBAL_BATCH // dp_size
    return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(out.dtype, torch.float32)  # a bf16 model's loss in fp32
    return ((out.to(dtype) - y.to(dtype)) ** 2).mean()


def dp_setup(seed: int = 0, bucket_numel: int = 64, dtype: torch.dtype = STRICT_DTYPE,
             use_distributed_optimizer: bool = True, **ddp_kwargs):
    """(reference copy of the model, ReferenceDataParallel over the whole world as DP). Buckets are
    packed without alignment padding, so that at DP=4 every rank owns part of several buckets."""
    model = make_model(seed, dtype)
    reference = copy.deepcopy(model)
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    return reference, ReferenceDataParallel(model, group, bucket_size=bucket_numel, alignment=1,
                                            use_distributed_optimizer=use_distributed_optimizer, **ddp_kwargs)


def tp_setup(seed: int = 0, bucket_numel: int = 64, **ddp_kwargs):
    """(reference, ReferenceDataParallel, dp_rank, dp_size) on a (DP=2, TP=2) mesh: layer 0 column-parallel,
    layer 2 row-parallel (Replicate bias), layer 4 fully Replicate DTensors."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    tp = mesh["TP"]
    model = make_model(seed)
    reference = copy.deepcopy(model)
    parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    distribute_module(
        model[4], tp,
        input_fn=lambda mod, inputs, mesh_: tuple(DTensor.from_local(t, mesh_, [Replicate()]) for t in inputs),
        output_fn=lambda mod, out, mesh_: out.to_local(),
    )
    ddp = ReferenceDataParallel(model, mesh["DP"], bucket_size=bucket_numel, alignment=1, use_distributed_optimizer=True,
                                **ddp_kwargs)
    return reference, ddp, mesh.get_local_rank("DP"), 2


def train(ddp, opt, steps: int, dp_rank: int, dp_size: int, first_step: int = 0, dtype=STRICT_DTYPE,
          scheduler=None) -> None:
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        x, y = local_batch(step, dp_rank, dp_size, dtype)
        loss_fn(ddp(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def train_reference(model, opt, steps: int, clip: float = 0.0, first_step: int = 0, scheduler=None) -> None:
    train_one_process(model, (batch(step) for step in range(first_step, first_step + steps)), optimizer=opt,
                      loss_fn=loss_fn, clip=clip, scheduler=scheduler)


def mean_micro_batch_grads(reference: nn.Module, step: int, dp_size: int, dtype=STRICT_DTYPE,
                           reverse: bool = False) -> dict[str, torch.Tensor]:
    """What data parallelism computes in fp32: each rank's micro-batch grad, cast up, averaged
    (``reverse``: summed in the other order, for a measured tolerance)."""
    grads = {n: torch.zeros(p.shape) for n, p in reference.named_parameters()}
    for r in reversed(range(dp_size)) if reverse else range(dp_size):
        reference.zero_grad()
        x, y = local_batch(step, r, dp_size, dtype)
        loss_fn(reference(x), y).backward()
        for n, p in reference.named_parameters():
            grads[n] += p.grad.float() / dp_size
    return grads


def assert_params_match(model: nn.Module, reference: nn.Module, tol: Tolerance | None = None) -> None:
    """Every parameter equals the reference's (strict for float64; ``tol`` otherwise)."""
    ours = dict(model.named_parameters())
    for name, ref in reference.named_parameters():
        assert_close(ours[name], ref, name=name, tol=tol)
