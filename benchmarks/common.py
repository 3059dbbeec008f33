"""What every benchmark's process tree needs: spawn ranks, set each one up, time fairly on any device."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["init_rank", "mlp", "spawn", "sync"]


def spawn(worker: Callable[..., None], world: int, *args: Any) -> Any:
    """Run ``worker(rank, world, port, *args, queue)`` on ``world`` fresh processes; return what the
    ranks put on ``queue`` (the first item). Fresh processes keep one run's memory out of the next."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(world, port, *args, queue), nprocs=world, start_method="spawn")
    return queue.get()


def init_rank(rank: int, world: int, port: int, device_type: str = "cpu", threads: int = 1) -> torch.device:
    """Join the process group with the device's default backend; return this rank's device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    if device_type != "cpu":
        module = torch.get_device_module(device_type)
        device = torch.device(device_type, rank % module.device_count())
        module.set_device(device)
    dist.init_process_group(dist.get_default_backend_for_device(device_type), rank=rank, world_size=world)
    return device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer measures it (a no-op on CPU)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def mlp(layers: int, width: int, classes: int = 10) -> torch.nn.Module:
    """The plain model the DDP and optimizer benchmarks share, seeded so every rank builds the same."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, classes))
