"""veScale's ``VeDeviceMesh`` spellings on :class:`~ndweave.mesh.ParallelMesh`, so a veScale script
runs with its imports changed.

Each is an alias of the ndweave method that answers the question veScale's name asks, with one
deliberate difference: where veScale answers with the wrong dim (its tensor-parallel "dim groups" are
those of mesh dim 0, the DP or PP dim of an nD mesh), these answer with the named dim. The mesh
README's "Coming from veScale" table lists every call.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ndweave.mesh.torch_compat import mesh_without_groups

__all__ = ["VeScaleAliases"]


class VeScaleAliases:
    """Mixin of :class:`~ndweave.mesh.ParallelMesh` (which provides every method used here)."""

    def get(self, **init_kwargs: Any) -> DeviceMesh | None:
        """The whole mesh as a torch ``DeviceMesh`` (``None`` if not initialized); with keyword
        arguments, an uninitialized mesh is first initialized with them (veScale's ``get``)."""
        if not self.is_initialized() and init_kwargs:
            self.init_device_mesh(**init_kwargs)
        return self.device_mesh if self.is_initialized() else None

    def get_local_rank(self, mesh_dim: str | int | None = None) -> int:
        """This rank's index along ``mesh_dim`` (torch's meaning). Without ``mesh_dim``: on a 1-D mesh
        its index in the mesh (torch's), on an nD mesh its rank on this node (veScale's meaning:
        ``LOCAL_RANK`` as set by torchrun, else the global rank), which torch leaves undefined there."""
        if mesh_dim is not None:
            return self.lookup_rank(mesh_dim)
        if self.ndim == 1:
            return self.lookup_rank(0)
        return int(os.environ.get("LOCAL_RANK", self.get_rank()))

    def get_data_parallel_dim_groups(self) -> dist.ProcessGroup | None:
        """Same as ``get_data_parallel_group()``."""
        return self.get_data_parallel_group()

    def get_tensor_parallel_dim_groups(self) -> dist.ProcessGroup | None:
        """Same as ``get_tensor_parallel_group()``: the ``"TP"`` dim's group (veScale's is mesh dim 0's)."""
        return self.get_tensor_parallel_group()

    def get_pipeline_parallel_dim_groups(self) -> dist.ProcessGroup | None:
        """Same as ``get_pipeline_parallel_group()``."""
        return self.get_pipeline_parallel_group()

    def get_global_tensor_parallel_meshes(self) -> list[DeviceMesh]:
        """Every tensor-parallel group's mesh (1-D, ``"TP"``), in rank order: this rank's is
        ``mesh["TP"]``; the others describe their ranks without process groups of their own."""
        return self._sibling_meshes(("TP",))

    def get_global_pipeline_parallel_meshes(self, device_type: str | None = None) -> list[DeviceMesh]:
        """Every pipeline stage's mesh (the mesh minus its ``"PP"`` dim), stage 0 first: this rank's is
        ``mesh[<the other dims>]``, the others have no process groups of their own. Without a PP dim,
        the one stage is the whole mesh. ``device_type`` is accepted for veScale's signature; the
        meshes are on this mesh's device type."""
        return self._sibling_meshes(tuple(n for n in self.mesh_dim_names if n != "PP"))

    def _sibling_meshes(self, keep: tuple[str, ...]) -> list[DeviceMesh]:
        indices = [self._dims_of(name)[0] for name in keep]
        rest = [i for i in range(self.ndim) if i not in indices]
        grids = self._grid_or_raise().transpose(rest + indices).reshape((-1, *(self.shape[i] for i in indices)))
        me = self.get_rank()
        return [self[keep] if me in grid else mesh_without_groups(self.device_type, grid.tolist(), keep) for grid in grids]
