"""The patches automatic plans name, each taking JSON arguments (``{"name": ..., "args": {...}}``).

- ``fused_colwise(pieces=k)``: a projection whose output the model cuts into ``k`` equal pieces
  (``[q | k | v]``, ``[gate | up]``), its parameters laid out ``_StridedShard(dim, split_factor=k)``
  by the plan: it runs the module's own forward on the local parameters and hands on the plain
  local ``[piece_0,r | ... | piece_k-1,r]``, so the model's own split gives this rank's pieces.
  Works for any module type (``nn.Linear``, GPT-2's ``Conv1D``, ...): it swaps the parameters.
- ``tp_divides(sizes=[...])``: refuses a tensor-parallel size that does not divide every sharded
  size of a block (its heads), naming the module; an uneven cut would split a head.
- ``replicated_local()``: a module whose parameters are all replicated (attention the plan could not
  shard, an MoE router and its experts) runs its forward on plain local tensors: its DTensor
  arguments, parameters and buffers are handed in as local tensors and its tensor outputs come back
  ``Replicate`` DTensors. Every rank computes the same thing, with no communication, whatever ops
  the forward uses (DTensor has no rule for some: ``nonzero``, ``topk`` on indices, ...) and
  whatever plain tensors it meets (rotary tables, masks).
- ``divide_attributes(names=[...])``: divides int attributes (``"num_heads"``,
  ``"config.num_attention_heads"``) by the tensor-parallel size, for forwards that reshape with a
  literal head count. An attribute of a shared object (a config) is changed on a copy owned by this
  module, so other modules keep theirs.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from ndweave.dmodule.patches import register_patch
from ndweave.mesh.torch_compat import StridedShard, tree_map

__all__ = ["divide_attributes", "fused_colwise", "replicated_local", "tp_divides"]


def _tp_size(device_mesh: DeviceMesh, fqn: str, what: str) -> int:
    if device_mesh.ndim != 1:
        raise ValueError(f"{fqn}: {what} is for a 1-D tensor-parallel mesh, not {device_mesh}")
    return device_mesh.size()


@register_patch("tp_divides")
def tp_divides(module: nn.Module, device_mesh: DeviceMesh, fqn: str, *, sizes: list[int]) -> None:
    """Refuse a mesh whose size does not divide every one of ``sizes``."""
    tp = _tp_size(device_mesh, fqn, "tp_divides")
    bad = [s for s in sizes if s % tp]
    if bad:
        raise ValueError(f"{fqn}: the plan splits its heads / features in pieces of sizes {sizes}; the {tp} ranks of "
                         f"{device_mesh} do not divide {bad} (a head would be cut): use a tensor-parallel size "
                         f"dividing {math.gcd(*sizes)}")


@register_patch("divide_attributes")
def divide_attributes(module: nn.Module, device_mesh: DeviceMesh, fqn: str, *, names: list[str]) -> None:
    """Divide each int attribute of ``names`` (dotted paths from ``module``) by the mesh size."""
    tp = _tp_size(device_mesh, fqn, "divide_attributes")
    for name in names:
        *path, leaf = name.split(".")
        owner = module
        for part in path:
            child = getattr(owner, part)
            if not isinstance(child, nn.Module):  # a shared object (a config): this module gets its own copy
                child = copy.copy(child)
                setattr(owner, part, child)
            owner = child
        value = getattr(owner, leaf)
        if not isinstance(value, int) or value % tp:
            raise ValueError(f"{fqn}.{name} = {value!r} does not split over the {tp} ranks of {device_mesh}; "
                             "use a tensor-parallel size dividing it")
        setattr(owner, leaf, value // tp)


@register_patch("fused_colwise")
def fused_colwise(module: nn.Module, device_mesh: DeviceMesh, fqn: str, *, pieces: int) -> None:
    """Make a fused projection compute on this rank's strided share of its parameters."""
    _tp_size(device_mesh, fqn, "fused_colwise")
    params = dict(module.named_parameters(recurse=False))
    for name, param in params.items():
        placements = tuple(param.placements) if isinstance(param, DTensor) else "a plain tensor"
        strided = isinstance(param, DTensor) and len(placements) == 1 and isinstance(placements[0], StridedShard)
        if not strided or placements[0].split_factor != pieces:
            raise ValueError(f"{fqn}.{name}: a projection fused from {pieces} pieces must be laid out "
                             f"[_StridedShard(dim, split_factor={pieces})] in the plan's parameter section (rank r "
                             f"holds its share of each piece); it is {placements}")
    forward = type(module).forward

    def local_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mesh = next(iter(params.values())).device_mesh
        if not isinstance(x, DTensor):  # a plain input is the full activation, the same on every rank
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        elif x.placements != (Replicate(),):  # (only when needed: see hf_gpt2's fused_qkv_colwise)
            x = x.redistribute(mesh, [Replicate()])
        # each rank's input gradient covers only its own pieces: a partial sum, reduced on the way back
        x = x.to_local(grad_placements=[Partial()])
        with _swapped(module, {name: p.to_local() for name, p in params.items()}):
            return forward(module, x, *args, **kwargs)

    module.forward = local_forward


@register_patch("replicated_local")
def replicated_local(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Run ``module`` on plain local tensors (see the module docstring)."""
    tensors = [(m, table, name, t) for m in module.modules() for table in (m._parameters, m._buffers)
               for name, t in table.items() if isinstance(t, DTensor)]
    for m, table, name, t in tensors:
        if any(not isinstance(p, Replicate) for p in t.placements):
            raise ValueError(f"replicated_local on {fqn!r}: {name} of {type(m).__name__} is laid out {t.placements}; "
                             "the patch is for modules whose tensors are all replicated")
    forward = type(module).forward

    def local_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(_to_local, (args, kwargs))
        saved = [(table, name, table[name]) for _, table, name, _ in tensors]
        try:
            for table, name, t in saved:
                table[name] = t.to_local()
            out = forward(module, *args, **kwargs)
        finally:
            for table, name, t in saved:
                table[name] = t
        return tree_map(lambda x: DTensor.from_local(x, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
                        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x, out)

    module.forward = local_forward


def _to_local(x: Any) -> Any:
    if not isinstance(x, DTensor):
        return x
    replicated = [Replicate()] * x.device_mesh.ndim
    if tuple(x.placements) != tuple(replicated):
        x = x.redistribute(x.device_mesh, replicated)
    return x.to_local(grad_placements=replicated)


@contextmanager
def _swapped(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters replaced by ``tensors`` for the duration (restored even on error)."""
    saved = {name: module._parameters[name] for name in tensors}
    try:
        module._parameters.update(tensors)
        yield
    finally:
        module._parameters.update(saved)

