"""What a run did, the same on every rank (:class:`RunResult`), and how it is gathered."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["RunResult", "by_step", "gather_params", "peak_memory"]


@dataclass
class RunResult:
    """What a run did, the same on every rank."""

    losses: dict[int, float]
    """Global mean loss of each step this run trained (steps count from 1)."""
    params: dict[str, torch.Tensor]
    """The final whole-model parameters (CPU), by FQN, tied weights under both names."""
    seconds: float = 0.0
    """Wall time of the training steps."""
    tokens_per_s: float = 0.0
    """Tokens trained on per second of ``seconds``, over all ranks."""
    peak_memory: list[int] = field(default_factory=list)
    """Each rank's peak memory in bytes (host RSS on CPU, allocated device memory on CUDA)."""
    mesh: str = ""
    """The mesh it ran on, e.g. ``"PP=2 x DP=2 x TP=2"``."""
    history: dict[int, float] = field(default_factory=dict)
    """Every step's loss since the run began, earlier runs it resumed from included (from the checkpoint)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """The validation loss at every ``--eval-every``-th step since the run began (and the last step)."""
    sample: str = ""
    """The text the trained model wrote (``--sample``)."""
    mfu: float | None = None
    """Estimated model FLOPs utilization over ``seconds`` (None: not on a GPU whose peak is known)."""
    tensor_peak: list[int] = field(default_factory=list)
    """``--memory-check``: each rank's peak of live tensor bytes over the training steps (checkpoint
    saves left out), by torch's tracker; empty otherwise."""


def gather_params(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's parameters, unsharded, on every rank (small models: simplest correct way)."""
    local = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters(remove_duplicate=False):
            # full_tensor is a collective over TP: every TP rank holds the same chunk, same order;
            # cloned: a parameter is a view of DDP's flat buffer, which pickling would send whole
            local[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
    everyone: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, local)
    return {k: v for part in everyone for k, v in part.items()}


def peak_memory(device: str) -> int:
    """This process's peak memory: allocated device memory on CUDA, else host RSS."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def by_step(history: list[float]) -> dict[int, float]:
    """A per-step history (NaN: not there) by step number."""
    return {i + 1: v for i, v in enumerate(history) if not math.isnan(v)}
