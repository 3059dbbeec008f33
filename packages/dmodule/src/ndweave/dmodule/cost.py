"""The model of dmodule's own layout for a memory estimate: every parameter's local shape on one rank
under a plan, from a model built on meta, with no process group or ``DeviceMesh``.

It follows ``parallelize_module`` step by step (``api.py``): the plan's parameter section matched to
the model (the same matching and checks), every other parameter ``Replicate``; tensor parallel only
over a ``"TP"`` dim of more than one rank where the mesh has an ``"EP"`` dim; the ``expert_parallel``
patch's modules ``Shard(0)`` over ``"EP"`` (``Replicate`` over ``"TP"``). The local shape is torch's own
(``torch_compat.local_shape_at``), so uneven vocabularies and ``_StridedShard`` come out as DTensor
makes them. ``tests/dmodule/test_dmodule_cost.py`` checks it against real ``parallelize_module``.

:func:`parallelize_on_meta` is ``parallelize_module`` itself on a model built on meta: its tensors
become meta DTensors with this rank's local shapes, so one forward and backward on meta inputs (over
a fake process group, ``ndweave.mesh.fake_world``) shows the activations and collectives
tensor parallelism makes, with nothing allocated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ndweave.dmodule.api import _parallelize, _patch_targets
from ndweave.dmodule.experts.parallel import EXPERT_DIM, expert_parallel
from ndweave.dmodule.plan import check_placements, match_modules, names_removed_module, no_match_error
from ndweave.dmodule.spec import PlacementSpec, normalize_plan, split_key
from ndweave.mesh.torch_compat import local_shape_at, own_buffers, own_parameters

__all__ = ["local_param_shapes", "parallelize_on_meta"]


def local_param_shapes(model: nn.Module, plan: Mapping[str, Any] | None, mesh_shape: Mapping[str, int],
                       coordinate: Mapping[str, int]) -> dict[str, torch.Size]:
    """``{fqn: local shape}`` of every parameter of ``model`` (tied ones once, under their first FQN)
    on the rank at ``coordinate`` after ``parallelize_module(model, mesh, plan)`` over a mesh of
    ``mesh_shape``; nothing is allocated (build ``model`` on meta).

    ``mesh_shape`` names the mesh's dims as ``parallelize_module`` reads them: its ``"TP"`` dim (and
    ``"EP"`` for the ``expert_parallel`` patch) where it has one, every other dim ignored
    (``{"PP": 2, "DP": 4, "TP": 2}`` is a job's mesh); a mesh with neither is a torch ``DeviceMesh``
    taken whole (nD tensor parallel). ``coordinate`` gives this rank's index on each of those dims.
    A pipeline stage's chunk counts only the parameters it holds. Example::

        with torch.device("meta"):
            model = GPT(config)
        shapes = local_param_shapes(model, get_plan("nanogpt", model), {"DP": 2, "TP": 2}, {"DP": 0, "TP": 1})
        nbytes = sum(s.numel() * model.get_parameter(n).element_size() for n, s in shapes.items())
    """
    _check_mesh(mesh_shape, coordinate)
    rules = normalize_plan(plan, None, None, None)
    tensor_dims, tensor_parallel = _tensor_dims(mesh_shape)
    planned = _planned_placements(model, rules.parameter, [mesh_shape[d] for d in tensor_dims]) if tensor_parallel else {}
    experts = _expert_params(model, rules.patch, mesh_shape)
    expert_dims = (EXPERT_DIM, "TP") if tensor_parallel and EXPERT_DIM in mesh_shape else (EXPERT_DIM,)
    shapes = {}
    for fqn, p in model.named_parameters():
        if id(p) in experts:
            dims, placements = expert_dims, [Shard(0)] + [Replicate()] * (len(expert_dims) - 1)
        else:
            dims, placements = tensor_dims, planned.get(id(p), [Replicate()] * len(tensor_dims))
        shapes[fqn] = torch.Size(local_shape_at(p.shape, [mesh_shape[d] for d in dims],
                                                [coordinate[d] for d in dims], placements))
    return shapes


def parallelize_on_meta(model: nn.Module, mesh: Any, plan: Mapping[str, Any] | None, **kwargs: Any) -> nn.Module:
    """``parallelize_module(model, mesh, plan, **kwargs)`` for a ``model`` built on meta, values
    undefined: every tensor a meta DTensor (plain ones on meta) with the local shape this rank gets,
    every hook and patch installed as for a real model. For estimates only (``parallelize_module``
    refuses a meta model, which has no values to train). Example::

        with fake_world(4, rank=1):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
            with torch.device("meta"):
                model = GPT(config)
            sharded = parallelize_on_meta(model, mesh["TP"], get_plan("nanogpt", model))
            sharded(torch.zeros(2, 64, dtype=torch.long, device="meta"))   # TP's activations, on meta
    """
    return _parallelize(model, mesh, plan, kwargs.pop("param_sharding_plan", None),
                        kwargs.pop("fwd_resharding_plan", None), kwargs.pop("is_model_sharded", False),
                        kwargs.pop("factory", False), kwargs.pop("patches", None),
                        kwargs.pop("use_local_output", True), on_meta=True, **kwargs)


def _check_mesh(mesh_shape: Mapping[str, int], coordinate: Mapping[str, int]) -> None:
    for name, size in mesh_shape.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"local_param_shapes: mesh dim {name!r} has size {size!r}; give a positive int per dim")
        at = coordinate.get(name)
        if not isinstance(at, int) or not 0 <= at < size:
            raise ValueError(f"local_param_shapes: coordinate {dict(coordinate)} has {name!r} = {at!r}; give an index "
                             f"in [0, {size}) for every dim of mesh_shape {dict(mesh_shape)}")


def _tensor_dims(mesh_shape: Mapping[str, int]) -> tuple[tuple[str, ...], bool]:
    """(the dims tensors are laid out on, whether that is tensor parallel): ``api._resolve`` on names."""
    names = tuple(mesh_shape)
    if EXPERT_DIM in names:  # experts over "EP"; tensors over "TP" only where it has several ranks
        return (("TP",), True) if mesh_shape.get("TP", 1) > 1 else ((), False)
    return (("TP",), True) if "TP" in names else (names, True)


class _MeshShape:
    """Stands in for a mesh of ``sizes`` in ``plan.check_placements`` (its sizes and its name in errors)."""

    def __init__(self, sizes: Sequence[int]):
        self.shape = tuple(sizes)
        self.ndim = len(self.shape)
        self.mesh_dim_names = None

    def size(self, mesh_dim: int) -> int:
        return self.shape[mesh_dim]


def _planned_placements(root: nn.Module, param_plan: dict[str, PlacementSpec],
                        sizes: Sequence[int]) -> dict[int, tuple[Placement, ...]]:
    """``{id(parameter): placements}`` for the parameters the plan names, matched and checked as
    ``parallelize_module`` does (the last key naming a tensor wins)."""
    mesh = _MeshShape(sizes)
    chosen: dict[int, tuple[Placement, ...]] = {}
    for key, spec in param_plan.items():
        regex, leaf = split_key(key)
        hits = [m for _, m in match_modules(root, regex, key) if leaf in own_parameters(m) or leaf in own_buffers(m)]
        if not hits and not names_removed_module(root, regex):
            raise no_match_error("parameter", key, (name for name, _ in root.named_parameters(remove_duplicate=False)))
        for m in hits:
            p = own_parameters(m).get(leaf)
            if p is not None:
                chosen[id(p)] = check_placements(spec, p, mesh, f"parameter {key!r}")
    return chosen


def _expert_params(root: nn.Module, patch_plan: dict[str, list], mesh_shape: Mapping[str, int]) -> set[int]:
    """``id``s of the parameters the plan's ``expert_parallel`` patch divides over ``"EP"``."""
    found = set()
    for fqn, m, patch in _patch_targets(root, patch_plan):
        if getattr(patch, "func", patch) is expert_parallel:
            if EXPERT_DIM not in mesh_shape:
                raise ValueError(f"local_param_shapes: the plan divides the experts of {fqn!r} over an {EXPERT_DIM!r} "
                                 f"dim, and mesh_shape {dict(mesh_shape)} has none; add one (\"EP\": 1 keeps them whole)")
            found.update(id(p) for p in m.parameters(recurse=False))
    return found
