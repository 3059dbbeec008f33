"""A simulated device for tests and benchmarks: blocks whose kernel sleeps instead of computing.

``time.sleep`` leaves the CPU free, as a GPU kernel does, so every PP rank gets a "device" of its own
even on a few shared cores, and a pipeline's measured step and bubble can be held against the theory
(``benchmarks/bench_pipeline.py --simulate-ms``, ``tests/pipeline/test_pipeline_step_time.py``)::

    model = KernelStack(num_layers=8, width=64, kernel_ms=10)   # each block: forward 10 ms, backward 20 ms
"""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["KernelStack", "SimulatedKernel"]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(2 * ctx.seconds)  # a backward costs about twice its forward
        return grad, None


class SimulatedKernel(nn.Module):
    """The identity, with a forward that waits ``ms`` milliseconds and a backward twice that, using no CPU."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.seconds = ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.seconds)


class KernelStack(nn.Module):
    """``num_layers`` blocks of ``Linear(width)`` + ReLU, each followed by a :class:`SimulatedKernel`
    of ``kernel_ms`` (none at 0); every block takes and gives ``(batch, width)``."""

    def __init__(self, num_layers: int, width: int, kernel_ms: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), *([SimulatedKernel(kernel_ms)] if kernel_ms else []))
            for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
