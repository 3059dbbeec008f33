"""``resolve_mesh``: the one place every package turns its ``mesh`` argument into a torch mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ndweave.mesh.parallel_mesh import DEVICE_MESH, ParallelMesh

__all__ = ["resolve_mesh"]
def resolve_mesh(
    mesh: "ParallelMesh | DeviceMesh | dist.ProcessGroup | None" = None, dim: str | None = None
) -> DeviceMesh:
    """The torch ``DeviceMesh`` an ndweave API should run on.

    Every package funnels its ``mesh`` argument through here: ``None`` means the default
    :data:`DEVICE_MESH`; a ``ParallelMesh`` or a multi-dim ``DeviceMesh`` is narrowed to ``dim`` when
    given; a ``ProcessGroup`` becomes a 1-D mesh over its ranks.
    """
    if mesh is None:
        if not DEVICE_MESH.is_initialized():
            raise RuntimeError(
                "no mesh was passed and the default DEVICE_MESH is not initialized; pass a mesh, or call "
                "DEVICE_MESH.init_device_mesh(device_type, mesh_shape, mesh_dim_names=...) first"
            )
        mesh = DEVICE_MESH
    if isinstance(mesh, ParallelMesh):
        return mesh[dim] if dim is not None else mesh.device_mesh
    if isinstance(mesh, DeviceMesh):
        if dim is None or (mesh.ndim == 1 and mesh.mesh_dim_names in (None, (dim,))):
            return mesh
        names = mesh.mesh_dim_names or ()
        if dim not in names:
            raise KeyError(f"mesh {mesh} has no dim {dim!r}; its dims are {list(names)}")
        return mesh[dim]
    if isinstance(mesh, dist.ProcessGroup):
        backend = dist.get_backend(mesh)
        device_type = "cpu" if backend == "gloo" else _accelerator_type()
        return DeviceMesh.from_group(mesh, device_type, mesh_dim_names=(dim,) if dim else None)
    raise TypeError(f"expected a ParallelMesh, DeviceMesh, ProcessGroup or None; got {type(mesh).__name__}")


def _accelerator_type() -> str:
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return acc.type if acc is not None else "cpu"
