"""``ParallelMesh``: a torch ``DeviceMesh`` plus named-dim rank mapping and role getters.

It *is* a torch ``DeviceMesh`` (a subclass sharing the state of the mesh torch built), so it goes
wherever torch takes one: DTensor, FSDP1 and FSDP2, ``get_group(mesh_dim=...)``. ``mesh["TP"]`` is
torch's own submesh. What it adds is arithmetic that torch only offers for the calling rank
(coordinates of *any* rank, sibling groups, pipeline neighbours), role getters that return the right
dim, veScale's spellings (:class:`~ndweave.mesh.vescale.VeScaleAliases`), and errors that say what to do.

A subclass, not a forwarding wrapper: torch checks ``isinstance(mesh, DeviceMesh)`` (FSDP1) and
compares meshes by type and state (DTensor). It adopts the state of the mesh torch built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Union

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh

from ndweave.mesh import elastic, layout
from ndweave.mesh.lifecycle import collective_timeout
from ndweave.mesh.mesh_args import check_device_type, check_mesh_dim_names, check_mesh_shape
from ndweave.mesh.torch_compat import adopt_mesh_state, drop_mesh_state, flatten_mesh, set_group_timeout
from ndweave.mesh.vescale import VeScaleAliases

__all__ = ["ParallelMesh", "DEVICE_MESH", "init_device_mesh", "DEFAULT_DIM_NAMES", "Dim", "ROLE_DIMS", "EXPERT_DIM",
           "CONTEXT_DIM"]

#: Default names for a mesh of n <= 3 dims are the last n of these (outermost first): a 2-D mesh is
#: ("DP", "TP"), so TP, the most communication-hungry dim, gets neighbouring ranks (same node).
DEFAULT_DIM_NAMES = ("PP", "DP", "TP")

#: A mesh dim given by name ("TP", or a flattened name) or by position.
Dim = Union[str, int]

#: The dim each role's getters read (``get_<role>_parallel_rank/mesh/group``): a role whose dim the
#: mesh lacks has size 1. Expert-parallel ranks split the batch like DP ranks and divide the experts;
#: context-parallel ranks split each sequence (their parameters' grads reduce as DP ranks' do).
ROLE_DIMS = {"pipeline": "PP", "data": "DP", "context": "CP", "expert": "EP", "tensor": "TP"}

#: The dim experts are divided over (dmodule's ``expert_parallel`` patch; DDP's data dims with DP).
EXPERT_DIM = ROLE_DIMS["expert"]

#: The dim each sequence is split over (dmodule's ``context.ContextParallel``).
CONTEXT_DIM = ROLE_DIMS["context"]


def _default_backend(device_type: str) -> str:
    # torch knows the pairing (cpu -> gloo, cuda -> nccl, xpu -> xccl, ...): never hard-code it.
    return dist.get_default_backend_for_device(device_type)


class ParallelMesh(VeScaleAliases, DeviceMesh):
    """A named nD device mesh with rank mapping for every rank, not just the caller.

    A torch ``DeviceMesh`` once initialized (equal to ``.device_mesh``, the mesh torch built): pass it
    to ``fully_shard``, FSDP, ``distribute_tensor`` as is. Where a torch method takes a mesh dim,
    this one also takes a dim name (``size("TP")``, ``get_group(mesh_dim="TP")``).

    Create one explicitly with :func:`init_device_mesh`, or initialize the process-wide default
    :data:`DEVICE_MESH`::

        DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
        tp_mesh = DEVICE_MESH["TP"]          # torch DeviceMesh, ready for DTensor
        DEVICE_MESH.get_strategy_size("DP")  # 2
    """

    def __init__(self, device_mesh: DeviceMesh | None = None) -> None:
        # DeviceMesh.__init__ is not called: an empty ParallelMesh (DEVICE_MESH before its init) has no
        # torch state yet; _adopt takes it from the mesh torch builds.
        self._torch_state: tuple[str, ...] = ()
        self._mesh: DeviceMesh | None = None
        self._grid: np.ndarray | None = None
        # flattened name -> indices of the root dims it spans, in order; and its torch mesh, kept
        # here because torch is deprecating lookups of flattened names on the root mesh
        self._flattened: dict[str, tuple[int, ...]] = {}
        self._flat_meshes: dict[str, DeviceMesh] = {}
        # torch builds a new DeviceMesh per slice (~7 ms of CPU on 2 cores, torch 2.13): a job that slices
        # per step (its loss's mean over DP) would spend a tenth of a small step there
        self._submeshes: dict[tuple[str, ...], DeviceMesh] = {}
        # the collective timeout of the groups it made (None: a torch mesh adopted as is)
        self._timeout: timedelta | None = None
        if device_mesh is not None:
            self._adopt(device_mesh)

    # ------------------------------------------------------------------ creation
    def init_device_mesh(
        self,
        device_type: str,
        mesh_shape: Sequence[int],
        *,
        mesh_dim_names: Sequence[str] | None = None,
        check_uniqueness: bool = False,
        timeout: timedelta | float | None = None,
    ) -> DeviceMesh:
        """Build the mesh (and the default process group if none exists); return the torch mesh.

        ``mesh_dim_names`` default to the last ``len(mesh_shape)`` of ``("PP", "DP", "TP")`` and must
        be given for more than three dims. With ``check_uniqueness=True`` a second initialization is
        an error instead of a silent replacement. ``timeout`` (seconds or a ``timedelta``; ``None``:
        ndweave's default, 300 s, ``lifecycle.DEFAULT_TIMEOUT``) bounds every collective of the mesh's
        dim groups (and of flattened ones), and of the default group when this call creates it (see
        ``ndweave.mesh.elastic``); a default group made before keeps its own. A ``device_type`` this
        process has no device of (``"cuda"`` without GPUs) is refused before anything is built.
        """
        if check_uniqueness and self._mesh is not None:
            raise RuntimeError(
                f"this ParallelMesh is already initialized as {self._short()}; with check_uniqueness=True "
                "it may be initialized once. Reuse it, or call reset() first."
            )
        check_device_type(device_type)
        shape = check_mesh_shape(mesh_shape)
        names = check_mesh_dim_names(shape, mesh_dim_names, DEFAULT_DIM_NAMES)
        timeout = collective_timeout(timeout)
        created = not dist.is_initialized()
        if created:
            elastic.init_process_group(_default_backend(device_type), timeout)
        world = dist.get_world_size()
        if math.prod(shape) != world:
            raise ValueError(
                f"mesh_shape {shape} holds {math.prod(shape)} ranks but the world has {world} processes; "
                f"choose a shape whose product is {world}."
            )
        self._adopt(_torch_init_device_mesh(device_type, shape, mesh_dim_names=names))
        self._timeout = timeout
        for group in {self._mesh[n].get_group() for n in names}:
            if created or group != dist.group.WORLD:  # a default group made elsewhere keeps its timeout
                set_group_timeout(group, timeout)
        return self._mesh

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> "ParallelMesh":
        """Wrap an existing torch ``DeviceMesh`` (it must have dim names)."""
        return cls(device_mesh)

    def _adopt(self, device_mesh: DeviceMesh) -> None:
        if not device_mesh.mesh_dim_names:
            raise ValueError("ParallelMesh needs named dims; build the DeviceMesh with mesh_dim_names=(...)")
        drop_mesh_state(self, self._torch_state)
        self._torch_state = adopt_mesh_state(self, device_mesh)
        self._mesh = device_mesh
        self._grid = device_mesh.mesh.cpu().numpy()
        self._flattened, self._flat_meshes, self._submeshes, self._timeout = {}, {}, {}, None

    def reset(self) -> None:
        """Forget the mesh (process groups stay alive); the next ``init_device_mesh`` starts afresh."""
        drop_mesh_state(self, self._torch_state)
        self._torch_state = ()
        self._mesh, self._grid, self._flattened, self._flat_meshes, self._timeout = None, None, {}, {}, None
        self._submeshes = {}

    def __getattr__(self, name: str):
        # Reached only for attributes the instance lacks: torch's DeviceMesh state before initialization.
        if name.startswith("__") or vars(self).get("_mesh") is not None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(
            f"ParallelMesh.{name}: this ParallelMesh is not initialized; call .init_device_mesh(device_type, "
            "mesh_shape, mesh_dim_names=...) first"
        )

    def is_initialized(self) -> bool:
        return self._mesh is not None

    # ------------------------------------------------------------------ torch views
    @property
    def device_mesh(self) -> DeviceMesh:
        """The whole mesh as a torch ``DeviceMesh``."""
        if self._mesh is None:
            raise RuntimeError(
                "this ParallelMesh is not initialized; call .init_device_mesh(device_type, mesh_shape, "
                "mesh_dim_names=...) first (or pass an explicit mesh)."
            )
        return self._mesh

    def __getitem__(self, dims: str | Sequence[str]) -> DeviceMesh:
        """``mesh["TP"]`` / ``mesh["DP", "TP"]``: torch submeshes, usable directly by DTensor/FSDP2."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        cached = self._submeshes.get(names)
        if cached is not None:
            return cached
        self._submeshes[names] = submesh = self._slice(names)
        return submesh

    def _slice(self, names: tuple[str, ...]) -> DeviceMesh:
        for name in names:
            self._dims_of(name)  # a clear error for unknown names
        if len(names) == 1 and names[0] in self._flat_meshes:
            return self._flat_meshes[names[0]]
        if names == tuple(self.mesh_dim_names):
            return self.device_mesh
        order = [self.mesh_dim_names.index(n) for n in names if n in self.mesh_dim_names]
        if order != sorted(order):  # torch refuses it too, without saying which order works
            ordered = tuple(sorted(names, key=self.mesh_dim_names.index))
            raise KeyError(f"mesh{list(names)}: a submesh keeps the mesh's dim order {self.mesh_dim_names}; "
                           f"ask for mesh{list(ordered)}")
        return self.device_mesh[names if len(names) > 1 else names[0]]

    def get_submesh(self, dims: str | Sequence[str]) -> DeviceMesh:
        """Same as ``mesh[dims]``."""
        return self[dims]

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(self.device_mesh.mesh_dim_names)

    @property
    def ndim(self) -> int:
        return self.device_mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.device_mesh.shape)

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    def size(self, mesh_dim: Dim | None = None) -> int:
        """Number of ranks in the whole mesh, or along ``mesh_dim`` (a name or an index)."""
        return self.device_mesh.size() if mesh_dim is None else self.get_strategy_size(mesh_dim)

    def get_strategy_size(self, dim: Dim) -> int:
        """Number of ranks along ``dim`` (``"TP"``, a flattened name, or a dim index)."""
        return math.prod(self.shape[d] for d in self._dims_of(dim))

    def get_group(self, mesh_dim: Dim | None = None) -> dist.ProcessGroup:
        """The process group of this rank along ``mesh_dim`` (a name or an index; may be left out on a
        1-D mesh, as in torch)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError(
                    f"{self._short()} has {self.ndim} dims; name the one whose group you want: "
                    f"get_group(mesh_dim={self.mesh_dim_names[-1]!r})"
                )
            mesh_dim = 0
        name = self.mesh_dim_names[self._dims_of(mesh_dim)[0]] if isinstance(mesh_dim, int) else mesh_dim
        return self[name].get_group()

    def has_dim(self, dim: str) -> bool:
        return dim in self.mesh_dim_names or dim in self._flattened

    # ------------------------------------------------------------------ rank mapping
    def get_rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    def get_strategy_coordinate(self, rank: int | None = None, *, local_rank: int | None = None) -> tuple[int, ...]:
        """Coordinate of global ``rank`` (default: this rank) in the mesh, one entry per dim.
        ``local_rank=`` is veScale's name for the same argument (a global rank there too)."""
        if local_rank is not None:
            if rank is not None:
                raise TypeError("get_strategy_coordinate: pass rank or local_rank (the same thing), not both")
            rank = local_rank
        return layout.coordinate_of(self._grid_or_raise(), self.get_rank() if rank is None else rank)

    def get_global_rank(self, coordinate: Mapping[str, int] | Sequence[int]) -> int:
        """Global rank at ``coordinate``: a tuple, or a mapping naming every dim (``{"DP": 1, "TP": 0}``)."""
        if isinstance(coordinate, Mapping):
            unknown = set(coordinate) - set(self.mesh_dim_names)
            missing = [n for n in self.mesh_dim_names if n not in coordinate]
            if unknown or missing:
                raise ValueError(
                    f"coordinate {dict(coordinate)} must name each mesh dim {self.mesh_dim_names} once"
                    + (f"; unknown: {sorted(unknown)}" if unknown else "")
                    + (f"; missing: {missing}" if missing else "")
                )
            coordinate = [coordinate[n] for n in self.mesh_dim_names]
        return layout.rank_at(self._grid_or_raise(), tuple(coordinate))

    def lookup_rank(self, dim: Dim, rank: int | None = None) -> int:
        """Index of ``rank`` (default: this rank) along ``dim``, e.g. its TP rank."""
        rank = self.get_rank() if rank is None else rank
        return layout.index_along(self._grid_or_raise(), rank, self._dims_of(dim))

    def get_all_submeshes(self, dim: Dim) -> list[list[int]]:
        """Global ranks of every sibling submesh along ``dim``.

        On a (DP=2, TP=2) mesh, ``get_all_submeshes("TP")`` is ``[[0, 1], [2, 3]]`` and
        ``get_all_submeshes("DP")`` is ``[[0, 2], [1, 3]]``.
        """
        return layout.groups_along(self._grid_or_raise(), self._dims_of(dim))

    def neighbor_rank(self, dim: Dim, offset: int, *, rank: int | None = None) -> int | None:
        """Global rank ``offset`` steps from ``rank`` along ``dim``; ``None`` past either end.

        ``neighbor_rank("PP", 1)`` is the next pipeline stage, ``neighbor_rank("PP", -1)`` the previous.
        """
        rank = self.get_rank() if rank is None else rank
        dims = self._dims_of(dim)
        target = self.lookup_rank(dim, rank) + offset
        if not 0 <= target < self.get_strategy_size(dim):
            return None
        return layout.rank_with_index_along(self._grid_or_raise(), rank, dims, target)

    def flatten(self, dims: Sequence[str], name: str) -> DeviceMesh:
        """A 1-D view over ``dims`` (e.g. ``("DP", "CP")``), addressable afterwards as ``mesh[name]``."""
        dims = tuple(dims)
        if name in self.mesh_dim_names or name in self._flattened:
            raise ValueError(f"mesh dim name {name!r} is taken; existing names: {self._all_names()}")
        indices = tuple(i for d in dims for i in self._dims_of(d))
        if len(set(indices)) != len(indices) or list(indices) != sorted(indices):
            raise ValueError(f"flatten needs distinct dims in mesh order {self.mesh_dim_names}; got {dims}")
        root_names = tuple(self.mesh_dim_names[i] for i in indices)
        flat = flatten_mesh(self.device_mesh[root_names], name)
        if self._timeout is not None and flat.get_group() != dist.group.WORLD:  # torch gives it the backend's default
            set_group_timeout(flat.get_group(), self._timeout)
        self._flattened[name] = indices
        self._flat_meshes[name] = flat
        return flat

    # ------------------------------------------------------------------ roles
    def is_first_stage(self) -> bool:
        """True on the first pipeline stage (always true without a PP dim)."""
        return self.get_pipeline_parallel_rank() == 0

    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (always true without a PP dim)."""
        return self.get_pipeline_parallel_rank() == self._role_size("pipeline") - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self._role_rank("pipeline")

    def get_pipeline_parallel_mesh(self) -> DeviceMesh | None:
        return self._role_mesh("pipeline")

    def get_pipeline_parallel_group(self) -> dist.ProcessGroup | None:
        return self._role_group("pipeline")

    def get_data_parallel_rank(self) -> int:
        return self._role_rank("data")

    def get_data_parallel_mesh(self) -> DeviceMesh | None:
        return self._role_mesh("data")

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self._role_group("data")

    def get_context_parallel_rank(self) -> int:
        return self._role_rank("context")

    def get_context_parallel_mesh(self) -> DeviceMesh | None:
        return self._role_mesh("context")

    def get_context_parallel_group(self) -> dist.ProcessGroup | None:
        return self._role_group("context")

    def get_expert_parallel_rank(self) -> int:
        return self._role_rank("expert")

    def get_expert_parallel_mesh(self) -> DeviceMesh | None:
        return self._role_mesh("expert")

    def get_expert_parallel_group(self) -> dist.ProcessGroup | None:
        return self._role_group("expert")

    def get_tensor_parallel_rank(self) -> int:
        return self._role_rank("tensor")

    def get_tensor_parallel_mesh(self) -> DeviceMesh | None:
        return self._role_mesh("tensor")

    def get_tensor_parallel_group(self) -> dist.ProcessGroup | None:
        return self._role_group("tensor")

    # A role whose dim the mesh lacks has size 1: rank 0, and no mesh or group to talk over.
    def _role_rank(self, role: str) -> int:
        dim = ROLE_DIMS[role]
        return self.lookup_rank(dim) if self.has_dim(dim) else 0

    def _role_size(self, role: str) -> int:
        dim = ROLE_DIMS[role]
        return self.get_strategy_size(dim) if self.has_dim(dim) else 1

    def _role_mesh(self, role: str) -> DeviceMesh | None:
        dim = ROLE_DIMS[role]
        return self[dim] if self.has_dim(dim) else None

    def _role_group(self, role: str) -> dist.ProcessGroup | None:
        dim = ROLE_DIMS[role]
        return self.get_group(dim) if self.has_dim(dim) else None

    # ------------------------------------------------------------------ display
    def describe(self) -> str:
        """The rank grid with dim names, this rank's coordinate marked with ``*``."""
        if self._mesh is None:
            return "ParallelMesh(uninitialized)"
        grid = self._grid
        me = dist.get_rank() if dist.is_initialized() else None
        width = len(str(grid.max()))
        lines = [f"{self._short()} on {self.device_type}"]
        if me is not None and me in grid:
            coord = self.get_strategy_coordinate(me)
            lines[0] += f"; rank {me} at " + ", ".join(f"{n}={c}" for n, c in zip(self.mesh_dim_names, coord))
        # print 2-D slices: rows are the second-to-last dim, columns the last
        planes = grid.reshape((-1,) + grid.shape[-2:]) if grid.ndim >= 2 else grid.reshape(1, 1, -1)
        outer = list(np.ndindex(*grid.shape[:-2])) if grid.ndim > 2 else [()]
        col_name = self.mesh_dim_names[-1]
        row_name = self.mesh_dim_names[-2] if grid.ndim >= 2 else ""
        for idx, plane in zip(outer, planes):
            if idx:
                lines.append("  " + ", ".join(f"{n}={c}" for n, c in zip(self.mesh_dim_names, idx)) + ":")
            lines.append(f"    {row_name:>4} \\ {col_name}")
            for r, row in enumerate(plane):
                cells = " ".join(f"{v:>{width}}" + ("*" if v == me else " ") for v in row.tolist())
                lines.append(f"    {r:>4} | {cells}")
        if self._flattened:
            lines.append("  flattened: " + ", ".join(
                f"{n}=({','.join(self.mesh_dim_names[i] for i in d)})" for n, d in self._flattened.items()))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()

    # ------------------------------------------------------------------ helpers
    def _short(self) -> str:
        return "ParallelMesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.shape)) + ")"

    def _all_names(self) -> list[str]:
        return list(self.mesh_dim_names) + list(self._flattened)

    def _grid_or_raise(self) -> np.ndarray:
        self.device_mesh  # raises the "not initialized" error
        return self._grid

    def _dims_of(self, dim: Dim) -> tuple[int, ...]:
        names = self.mesh_dim_names
        if isinstance(dim, int) and not isinstance(dim, bool):
            if not -len(names) <= dim < len(names):
                raise IndexError(f"mesh dim {dim} is out of range for a {len(names)}-D mesh {names}")
            return (dim % len(names),)
        if dim in self._flattened:
            return self._flattened[dim]
        if dim in names:
            return (names.index(dim),)
        raise KeyError(f"mesh has no dim {dim!r}; its dims are {self._all_names()}")


#: The process-wide default mesh (veScale's ``VESCALE_DEVICE_MESH``). Created empty: nothing happens
#: until someone calls ``DEVICE_MESH.init_device_mesh(...)``. Every ndweave API that takes a mesh
#: falls back to it when none is passed; it is the only global state ndweave keeps.
DEVICE_MESH = ParallelMesh()


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None,
    timeout: timedelta | float | None = None,
) -> ParallelMesh:
    """A new, explicit :class:`ParallelMesh` (the default :data:`DEVICE_MESH` is left alone)."""
    mesh = ParallelMesh()
    mesh.init_device_mesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names, timeout=timeout)
    return mesh
