"""The mesh dims that split the batch, and which of them each parameter's grad is reduced over.

Data parallelism splits the batch over the ``"DP"`` dim. Expert parallelism splits it over its
``"EP"`` dim too: every EP rank routes its own tokens, and only the experts are divided among the EP
ranks. Context parallelism splits each sequence over its ``"CP"`` dim: every CP rank trains on its
own tokens with the same parameters. So the *data dims* of a mesh are ``"DP"`` and, where the mesh
has them, ``"CP"`` and ``"EP"``, and each parameter's grad is reduced over the data dims it is
**not** sharded on (no parameter is sharded over CP):

* dense params (plain tensors, TP DTensors): over DP x EP, one flattened group;
* experts (DTensors ``Shard(0)`` over EP: each EP rank holds whole experts): over DP only. Their
  local grad already sums the contributions of every EP rank's tokens (the backward of the token
  all-to-all brings them back), so DP is all that is left to sum.

Averaging divides every grad by the number of ranks that split the batch (DP x CP x EP) whatever group
it is reduced over: each rank's loss is a mean over its own tokens, and the global loss their mean
over all of them. Worked example, mesh ``("DP", "EP") = (2, 2)`` on ranks 0..3 (rank = 2 * dp + ep):
a dense grad is summed over ranks {0, 1, 2, 3}; expert 0's (held by EP rank 0) over {0, 2}; every
grad is scaled by 1/4.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ndweave.mesh import CONTEXT_DIM, EXPERT_DIM, ParallelMesh, resolve_mesh
from ndweave.mesh.torch_compat import flatten_mesh, is_shard_like

__all__ = ["DataMesh", "EXPERT_DIM", "resolve_data_mesh"]


class DataMesh:
    """The data dims of a mesh (``dims``, in mesh order) and their groups, made once each."""

    def __init__(self, mesh: DeviceMesh, dims: tuple[str, ...], primary: str) -> None:
        self.mesh = mesh
        """The data submesh: 1-D (``"DP"``, or ``"EP"`` alone) or more (``("DP", "CP", "EP")``, in mesh order)."""
        self.dims = dims
        self.primary = primary
        """The data-parallel dim proper (``dim=`` of DDP): params may never be sharded over it."""
        self._groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        self._ranks = {d: tuple(dist.get_process_group_ranks(self._sub(d).get_group())) for d in dims}

    def size(self, dims: tuple[str, ...] | None = None) -> int:
        """Ranks along ``dims`` (default: all the data dims: the ranks that split the batch)."""
        out = 1
        for d in self.dims if dims is None else dims:
            out *= len(self._ranks[d])
        return out

    def group(self, dims: tuple[str, ...] | None = None) -> dist.ProcessGroup | None:
        """The group over ``dims`` (default all; flattened if several); ``None`` over a single rank."""
        dims = self.dims if dims is None else dims
        if dims not in self._groups:
            if self.size(dims) == 1:
                self._groups[dims] = None
            elif len(dims) == 1:
                self._groups[dims] = self._sub(dims[0]).get_group()
            else:  # torch's flattening: made once per mesh and name, found again by the next wrapper
                self._groups[dims] = flatten_mesh(self._sub(dims), "_".join(dims)).get_group()
        return self._groups[dims]

    def reduction_dims(self, name: str, tensor: torch.Tensor) -> tuple[str, ...]:
        """The data dims ``tensor`` (a param or buffer named ``name``) is reduced and broadcast over:
        those it is not sharded on. ``ValueError`` for a tensor sharded over the DP dim (FSDP's
        business), or over an ``"EP"`` dim this mesh does not treat as data."""
        if not isinstance(tensor, DTensor):
            return self.dims
        _check_expert_dim_known(name, tensor, self.dims)
        sharded = set()
        for i, placement in enumerate(tensor.placements):
            if not is_shard_like(placement) or tensor.device_mesh.size(i) == 1:
                continue
            ranks = tuple(dist.get_process_group_ranks(tensor.device_mesh.get_group(i)))
            sharded |= {d for d in self.dims if self._ranks[d] == ranks}
        if self.primary in sharded:
            raise ValueError(
                f"parameter {name!r} is {list(tensor.placements)} on {tensor.device_mesh}, sharded over the "
                f"data-parallel dim {self.primary!r}; DDP needs params replicated over DP (shard them over DP with "
                "FSDP or a sharded optimizer instead)"
            )
        return tuple(d for d in self.dims if d not in sharded)

    def _sub(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        dims = (dims,) if isinstance(dims, str) else dims
        if self.mesh.ndim == 1 or dims == tuple(self.mesh.mesh_dim_names):
            return self.mesh
        return self.mesh[dims if len(dims) > 1 else dims[0]]


def resolve_data_mesh(mesh_or_group: ParallelMesh | DeviceMesh | dist.ProcessGroup | None, dim: str) -> DataMesh:
    """The data dims of DDP's mesh argument: ``dim`` and those of ``"CP"`` and ``"EP"`` the mesh has; a
    ``ProcessGroup`` or a 1-D mesh is one data dim."""
    if mesh_or_group is None or isinstance(mesh_or_group, DeviceMesh):
        whole = resolve_mesh(mesh_or_group)
        names = tuple(whole.mesh_dim_names or ())
        if any(d in names and d != dim for d in (CONTEXT_DIM, EXPERT_DIM)):
            dims = tuple(n for n in names if n in (dim, CONTEXT_DIM, EXPERT_DIM))
            return DataMesh(whole if dims == names else whole[dims if len(dims) > 1 else dims[0]], dims, dim)
    return DataMesh(_one_data_dim(mesh_or_group, dim), (dim,), dim)


def _one_data_dim(mesh_or_group, dim: str) -> DeviceMesh:
    try:
        mesh = resolve_mesh(mesh_or_group, dim)
    except KeyError as err:
        raise ValueError(
            f"DistributedDataParallel runs over the {dim!r} mesh dim, and {err.args[0] if err.args else err}; "
            f"pass the data-parallel submesh (mesh[{dim!r}]) or name the dim with dim=..."
        ) from None
    if mesh.ndim != 1:
        raise ValueError(f"the data-parallel mesh must be 1-D; got {mesh.ndim}-D {mesh}; pass mesh[{dim!r}]")
    return mesh


def _check_expert_dim_known(name: str, tensor: DTensor, dims: tuple[str, ...]) -> None:
    """An expert sharded over an ``"EP"`` dim DDP was not given: it would be averaged over DP only while
    the dense params miss EP's ranks altogether. Name the mesh to pass instead."""
    names = tuple(tensor.device_mesh.mesh_dim_names or ())
    if EXPERT_DIM in dims or EXPERT_DIM not in names:
        return
    if is_shard_like(tensor.placements[names.index(EXPERT_DIM)]):
        raise ValueError(
            f"parameter {name!r} is sharded over the expert-parallel dim {EXPERT_DIM!r} ({list(tensor.placements)} "
            f"on {tensor.device_mesh}), but DDP was given only the data dims {list(dims)}. EP ranks split the batch "
            f"too: pass the mesh holding both, DDP(model, mesh) with mesh['DP', '{EXPERT_DIM}'] or the whole mesh, so "
            "dense grads are reduced over DP x EP and expert grads over DP"
        )
