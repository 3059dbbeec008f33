"""Models, data and single-process references shared by the ddp tests (module-level: ranks import it).

Everything is float64 unless a test asks otherwise: parity is strict (``ndweave.mesh.testing.STRICT``)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import STRICT_DTYPE, train_one_process

GLOBAL_BATCH = 24
SEQ, HIDDEN, FFN = 4, 8, 16


# ---------------------------------------------------------------------- plain data parallel
class MLP(torch.nn.Module):
    def __init__(self, seed: int = 0, dtype=STRICT_DTYPE) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(6, 12, dtype=dtype)
        self.fc2 = torch.nn.Linear(12, 12, dtype=dtype)
        self.head = torch.nn.Linear(12, 3, dtype=dtype)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch(step: int, dtype=STRICT_DTYPE):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=dtype), torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=dtype)


def rows(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = x.shape[0] // size
    return x[rank * n : (rank + 1) * n]


def micro_batches(ddp, k: int, mode: str = "no_sync"):
    """Yield (index, context) for k micro-batches; only the last one syncs."""
    for i in range(k):
        last = i == k - 1
        if mode == "no_sync":
            yield i, (contextlib.nullcontext() if last else ddp.no_sync())
        else:
            ddp.set_is_last_microbatch(last)
            yield i, contextlib.nullcontext()


def _reference_run(model, batch_fn, num_steps: int, lr: float, momentum: float):
    """Single-process training on the full batch: the params after every step and the first grads."""
    run = train_one_process(model, (batch_fn(step) for step in range(num_steps)), loss_fn=F.mse_loss,
                            optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum),
                            keep_grads=True, keep_params="every")
    return run.params, run.grads[0]


def reference_mlp_run(num_steps: int, lr: float = 0.05, momentum: float = 0.9):
    return _reference_run(MLP(), batch, num_steps, lr, momentum)


# ---------------------------------------------------------------------- data x tensor parallel
class TPBlock(torch.nn.Module):
    """A sequence-parallel block built by hand from DTensor params.

    ``norm`` is a replicated weight multiplied with a sequence-sharded activation, so its grad comes
    out ``Partial`` on TP; ``w1``/``b1`` (Shard(0)) and ``w2`` (Shard(1)) are a column/row-parallel
    linear pair. ``mesh`` is the TP submesh, or the whole ("DP", "TP") mesh (params Replicate on DP).
    """

    def __init__(self, mesh=None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        full = {
            "norm": 1 + 0.1 * torch.randn(HIDDEN, dtype=STRICT_DTYPE),
            "w1": torch.randn(FFN, HIDDEN, dtype=STRICT_DTYPE) / HIDDEN**0.5,
            "b1": 0.1 * torch.randn(FFN, dtype=STRICT_DTYPE),
            "w2": torch.randn(HIDDEN, FFN, dtype=STRICT_DTYPE) / FFN**0.5,
        }
        self.mesh = mesh
        tp = {"norm": Replicate(), "w1": Shard(0), "b1": Shard(0), "w2": Shard(1)}
        for name, value in full.items():
            if mesh is not None:
                placements = [tp[name]] if mesh.ndim == 1 else [Replicate(), tp[name]]
                value = distribute_tensor(value, mesh, placements)
            self.register_parameter(name, torch.nn.Parameter(value))

    def forward(self, x):
        h = x * self.norm
        if isinstance(h, DTensor):  # gather the sequence for the column-parallel linear
            h = h.redistribute(h.device_mesh, [*h.placements[:-1], Replicate()])
        y = torch.tanh(h @ self.w1.T + self.b1)
        return y @ self.w2.T


def tp_batch(step: int):
    g = torch.Generator().manual_seed(2000 + step)
    shape = (GLOBAL_BATCH, SEQ, HIDDEN)
    return torch.randn(*shape, generator=g, dtype=STRICT_DTYPE), torch.randn(*shape, generator=g, dtype=STRICT_DTYPE)


def tp_loss(model, x, y, mesh, dp_rank: int, dp_size: int, mb: slice):
    """Loss of micro-batch ``mb`` of this DP rank's rows (TP submesh) or of the global batch (2-D)."""
    if mesh.ndim == 1:  # params on the TP submesh: this rank's rows, sequence sharded over TP
        xs, ys = rows(x, dp_rank, dp_size)[mb], rows(y, dp_rank, dp_size)[mb]
        xd = distribute_tensor(xs, mesh, [Shard(1)])
        yd = distribute_tensor(ys, mesh, [Replicate()])
    else:  # params on the ("DP", "TP") mesh: the global micro-batch, batch over DP, sequence over TP
        n = x.shape[0] // dp_size
        idx = torch.cat([torch.arange(r * n, (r + 1) * n)[mb] for r in range(dp_size)])
        xd = distribute_tensor(x[idx], mesh, [Shard(0), Shard(1)])
        yd = distribute_tensor(y[idx], mesh, [Shard(0), Replicate()])
    out = model(xd)
    out = out.redistribute(out.device_mesh, [*out.placements[:-1], Replicate()])
    return ((out - yd) ** 2).mean().full_tensor()


def reference_tp_run(num_steps: int, lr: float = 0.05, momentum: float = 0.9):
    return _reference_run(TPBlock(), tp_batch, num_steps, lr, momentum)


def dp_tp_mesh(tp_size: int):
    return init_device_mesh("cpu", (dist.get_world_size() // tp_size, tp_size), mesh_dim_names=("DP", "TP"))


def local_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the single-process tensor ``full`` laid out like ``like``."""
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements).to_local()
    return full


def expected_flat(bucket, reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's grad buffer as the single-process grads would fill it (padding zero)."""
    flat = bucket.grad_data.new_zeros(bucket.numel)
    for bp in bucket.params:
        flat[bp.offset : bp.offset + bp.numel] = local_of(reference[bp.name], bp.param).reshape(-1)
    return flat
