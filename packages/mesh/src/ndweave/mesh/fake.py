"""Single-process mode over torch's fake process group, for mesh logic at large logical sizes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Pretend to be ``rank`` of ``world_size`` in this process; collectives do nothing.

    Good for mesh arithmetic at sizes no machine here can run (64 ranks, 4-D meshes); useless for
    checking numbers, since no data moves. The default :data:`DEVICE_MESH` is reset on exit.
    """
    from ndweave.mesh import DEVICE_MESH
    from ndweave.mesh.torch_compat import fake_store

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group; one is already initialized")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        DEVICE_MESH.reset()
        dist.destroy_process_group()
