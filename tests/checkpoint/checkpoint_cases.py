"""Models and sharded state shared by the ``ndweave.checkpoint`` tests (torch and ndweave.mesh only)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ndweave.mesh.contracts import ShardLayout, StatePiece, slice_piece
from ndweave.mesh.testing import full_tensor
from ndweave.mesh.torch_compat import StridedShard

ROWS, COLS = 12, 5  # 12: each third of the fused rows splits over 2 and 4 ranks


def assert_same(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Bit-equal full values, by name: a checkpoint stores values, it does not compute them."""
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    for name, value in expected.items():
        got = full_tensor(actual[name])
        assert torch.equal(got, full_tensor(value).to(got.dtype)), f"{name}: {got} != {value}"


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def full_weights() -> dict[str, torch.Tensor]:
    """The global values of :class:`Fused`'s parameters."""
    return {"qkv": torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS),
            "bias": torch.arange(ROWS, dtype=torch.float64) / 10}


class Fused(nn.Module):
    """A fused [q | k | v] weight (``StridedShard`` on a mesh, DCP cannot describe it) and a bias
    (``Shard(0)``), or plain tensors without a mesh."""

    def __init__(self, mesh: DeviceMesh | None = None, *, strided: bool = True, seed: int | None = None) -> None:
        super().__init__()
        values = full_weights()
        if seed is not None:  # other values: a load must replace them
            values = {k: torch.randn(v.shape, dtype=v.dtype, generator=torch.Generator().manual_seed(seed))
                      for k, v in values.items()}
        if mesh is not None:
            layout = [StridedShard(0, split_factor=3)] if strided else [Shard(1)]
            values = {"qkv": distribute_tensor(values["qkv"], mesh, layout),
                      "bias": distribute_tensor(values["bias"], mesh, [Shard(0)])}
        self.qkv, self.bias = nn.Parameter(values["qkv"]), nn.Parameter(values["bias"])


class ShardedState:
    """Stand-in for a sharded optimizer's state: a ``StatePiece`` of ``(ROWS, COLS)`` tensors per rank,
    a flat range of the rank's local tensor (cutting rows anywhere) on a (DP, TP) grid, TP ``Shard(tp_dim)``
    or ``Replicate`` (``replicated=True``: TP ranks other than 0 hold replicas)."""

    def __init__(self, full: torch.Tensor, dp: int, tp: int, rank: int, *, tp_dim: int = 0,
                 replicated: bool = False) -> None:
        dp_rank, tp_rank = divmod(rank, tp)
        placement = Replicate() if replicated else Shard(tp_dim)
        layout = ShardLayout.from_placements(full.shape, (tp,), [placement], (tp_rank,))
        bounds = [layout.numel * i // dp for i in range(dp + 1)]
        self.piece = slice_piece(full, layout, bounds[dp_rank], bounds[dp_rank + 1], fqn="w")

    def state_dict(self) -> dict[str, StatePiece]:
        return {"w": self.piece}

    def load_state_dict(self, state_dict: dict[str, StatePiece]) -> None:
        self.piece = state_dict["w"]
