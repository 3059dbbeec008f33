"""``split_method="time"``: each layer's forward + backward, timed once on the example, to balance by.

Parameter counts say little about time: an embedding holds many parameters and costs almost
nothing, attention over a long sequence the reverse. The traced forward runs once for real on the
example inputs (``torch.fx.Interpreter`` over the model); each layer call is also run ``repeats``
times on its real inputs with a backward, timed (synchronizing the device), and the median kept.
Grads and the RNG state are left as they were. Every rank measures and the mean over all ranks is
used, so every rank cuts the same stages.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from ndweave.mesh.torch_compat import FakeTensor, tree_flatten, tree_map
from ndweave.pipeline.trace import ForwardGraph

__all__ = ["layer_seconds"]


def layer_seconds(model: nn.Module, forward: ForwardGraph, example_inputs: tuple, device_type: str,
                  repeats: int = 5) -> dict[str, float]:
    """Seconds of each layer's forward + backward on ``example_inputs`` (summed over its calls), the
    mean over every rank of the default process group."""
    device = _model_device(model)
    if any(t.is_meta for t in example_inputs):
        raise ValueError("split_method='time' runs the layers on the example: pass real example_inputs, not meta")
    grads = {p: p.grad for p in model.parameters()}
    timer = _LayerTimer(model, forward, repeats, device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        timer.run(*(t.to(device) for t in example_inputs))
    for param, grad in grads.items():
        param.grad = grad
    return _mean_over_ranks(timer.seconds, device_type)


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        if t.is_meta or isinstance(t, FakeTensor):
            raise ValueError("split_method='time' runs the layers to time them: build the model on a device "
                             "(not meta, not deferred_init), or split by 'uniform'")
        return t.device
    return torch.device("cpu")


class _LayerTimer(fx.Interpreter):
    def __init__(self, model: nn.Module, forward: ForwardGraph, repeats: int, device: torch.device) -> None:
        super().__init__(model, graph=forward.graph)
        self.constants, self.repeats, self.device = forward.constants, repeats, device
        self.seconds: dict[str, float] = {}

    def fetch_attr(self, target: str) -> Any:
        if target in self.constants:
            return self.constants[target].to(self.device)
        return super().fetch_attr(target)

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        leaves = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point())
                          if isinstance(t, torch.Tensor) else t, (args, kwargs))
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            with torch.enable_grad():
                out = module(*leaves[0], **leaves[1])
                differentiable = [t.sum() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if differentiable:
                    torch.autograd.backward(differentiable)
            if self.device.type != "cpu":
                torch.accelerator.synchronize()
            times.append(time.perf_counter() - start)
        self.seconds[target] = self.seconds.get(target, 0.0) + statistics.median(times)
        with torch.no_grad():
            return module(*args, **kwargs)


def _mean_over_ranks(seconds: dict[str, float], device_type: str) -> dict[str, float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seconds
    device = torch.device(device_type, torch.accelerator.current_device_index()) if device_type != "cpu" else "cpu"
    values = torch.tensor(list(seconds.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return dict(zip(seconds, (values / dist.get_world_size()).tolist()))
