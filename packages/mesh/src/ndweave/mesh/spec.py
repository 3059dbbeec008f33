"""A mesh from a parallel spec such as ``"pp=2,dp=-1,tp=2"``, for whatever world the job gets.

Policy (what flexes when the world changes): the dims given a size are fixed; at most one dim is
``-1`` and takes the rest of the world, ``world // product(fixed sizes)``. So a job restarted on
fewer or more ranks keeps its model layout (pipeline stages, tensor shards) and changes only its
data-parallel size, the one dim a checkpoint reshards freely and the data position survives. Pass
``allowed`` to restrict the flexible dim to sizes the job can use (a global batch that must divide,
say). A world that cannot host the spec is an error naming both numbers and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch.distributed as dist

from ndweave.mesh import elastic
from ndweave.mesh.mesh_args import check_device_type
from ndweave.mesh.parallel_mesh import DEFAULT_DIM_NAMES, ParallelMesh, init_device_mesh

__all__ = ["init_mesh_from_spec", "parse_spec", "resolve_spec"]


def parse_spec(spec: str | Mapping[str, int], dims: Sequence[str] = DEFAULT_DIM_NAMES) -> dict[str, int]:
    """``"pp=2,dp=-1,tp=2"`` (or a mapping) -> ``{"PP": 2, "DP": -1, "TP": 2}``, in ``dims`` order.

    Names are case-insensitive; every one of ``dims`` appears, those the spec leaves out with size 1."""
    dims = tuple(d.upper() for d in dims)
    sizes = dict.fromkeys(dims, 1)
    items = spec.items() if isinstance(spec, Mapping) else (
        item.partition("=")[::2] for item in spec.replace(" ", "").split(",") if item)
    for name, value in items:
        text = str(value)
        if name.upper() not in sizes or not text.lstrip("-").isdigit():
            raise ValueError(f"parallel spec item {name}={value}: expected NAME=SIZE with NAME one of "
                             f"{', '.join(d.lower() for d in dims)} and SIZE a positive integer or -1")
        sizes[name.upper()] = int(text)
    flexible = [d for d, n in sizes.items() if n == -1]
    if len(flexible) > 1 or any(n < 1 for n in sizes.values() if n != -1):
        raise ValueError(f"parallel spec {_show(sizes)}: sizes must be positive, and at most one dim may be -1 "
                         f"(the one that takes the rest of the world); got -1 for {flexible}")
    return sizes


def resolve_spec(spec: str | Mapping[str, int], world_size: int | None, *, dims: Sequence[str] = DEFAULT_DIM_NAMES,
                 allowed: Sequence[int] | None = None) -> dict[str, int]:
    """The spec's sizes on a world of ``world_size`` ranks: the ``-1`` dim becomes
    ``world_size // product(other sizes)``. ``world_size=None`` (not launched yet) resolves only a
    spec without ``-1``.

        resolve_spec("pp=2,dp=-1,tp=2", 16)  # {"PP": 2, "DP": 4, "TP": 2}
        resolve_spec("tp=4,dp=-1", 6)        # ValueError: ... 6 ranks ... multiple of 4 ...
    """
    sizes = parse_spec(spec, dims)
    fixed = math.prod(n for n in sizes.values() if n != -1)
    flexible = next((d for d, n in sizes.items() if n == -1), None)
    if flexible is not None:
        if world_size is None:
            raise ValueError(f"parallel spec {_show(sizes)} has {flexible}=-1, which needs the world size: "
                             "launch it under torchrun (--nproc-per-node N) or give every dim a size")
        if world_size % fixed:
            raise ValueError(
                f"parallel spec {_show(sizes)} cannot run on {world_size} ranks: its fixed dims need a "
                f"multiple of {fixed} ranks; launch a multiple of {fixed} ranks or make the fixed dims smaller")
        sizes[flexible] = world_size // fixed
        if allowed is not None and sizes[flexible] not in allowed:
            raise ValueError(f"parallel spec {_show(sizes)} on {world_size} ranks gives {flexible}="
                             f"{sizes[flexible]}, not one of the allowed sizes {sorted(allowed)}; launch "
                             f"{' or '.join(str(n * fixed) for n in sorted(allowed))} ranks")
    elif world_size is not None and fixed != world_size:
        raise ValueError(f"parallel spec {_show(sizes)} needs {fixed} ranks but the world has {world_size}; "
                         f"launch {fixed} (torchrun --nproc-per-node) or let one dim flex with -1")
    return sizes


def init_mesh_from_spec(device_type: str, spec: str | Mapping[str, int], *, dims: Sequence[str] = DEFAULT_DIM_NAMES,
                        allowed: Sequence[int] | None = None, timeout: timedelta | float | None = None) -> ParallelMesh:
    """A :class:`ParallelMesh` with dims ``dims`` (outermost first) sized by ``spec`` for the world
    this process is in (the default process group is created first if there is none, as
    ``init_device_mesh`` does)::

        mesh = init_mesh_from_spec("cpu", "pp=2,dp=-1,tp=2", timeout=30)   # under torchrun, any 4k ranks
    """
    if not dist.is_initialized():
        check_device_type(device_type)  # before torch fails to make a group for it
        elastic.init_process_group(dist.get_default_backend_for_device(device_type), timeout)
    sizes = resolve_spec(spec, dist.get_world_size(), dims=dims, allowed=allowed)
    return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes), timeout=timeout)


def _show(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{d.lower()}={n}" for d, n in sizes.items())
