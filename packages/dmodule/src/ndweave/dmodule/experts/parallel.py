"""Expert parallelism for an experts module that stacks its experts in 3-D weights, as transformers'
MoE models do (``MixtralExperts``: ``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``), called as
``experts(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``.

:func:`parallelize_experts` makes every stacked weight a DTensor ``Shard(0)`` over the ``"EP"`` mesh
dim (EP rank ``p`` holds experts ``[p * E/EP, (p + 1) * E/EP)`` whole; ``Replicate`` over ``"TP"``
where the mesh has one), so a checkpoint still saves each weight as its global ``(E, ...)`` tensor
under its FQN. Its forward becomes three steps:

1. :func:`~ndweave.dmodule.experts.dispatch.dispatch`: this rank's tokens go to the ranks of their
   experts (``all_to_all_single``, uneven splits), grouped by local expert;
2. the module's own forward (whichever ``_experts_implementation``) on the local weights, with local
   expert ids and unit weights: each received row is one (token, expert) pair;
3. :func:`~ndweave.dmodule.experts.dispatch.combine`: the rows go back and each token sums its
   experts' outputs weighted by the router's weights, as one process does.

Nothing is dropped (no capacity factor): the result equals one process's. From a plan, the
registered patch ``"expert_parallel"`` does this on the modules its key matches, over the ``"EP"``
dim of the mesh given to ``parallelize_module``::

    plan = {"patch": {r"model\\.layers\\.\\d+\\.mlp\\.experts": ["expert_parallel"]}}
    model = parallelize_module(model, mesh, plan)         # mesh ("DP", "EP") or ("DP", "EP", "TP")
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndweave.dmodule.experts.dispatch import combine, dispatch
from ndweave.dmodule.patches import register_patch
from ndweave.mesh import EXPERT_DIM
from ndweave.mesh.torch_compat import local_tensor, own_parameters, root_mesh, split_tensor

__all__ = ["DISPATCH_BREAK", "EXPERT_DIM", "EXPERT_PATCH", "expert_mesh", "expert_parallel", "parallelize_experts"]

#: The registered name of :func:`expert_parallel`.
EXPERT_PATCH = "expert_parallel"
#: Why a compiled block breaks its graph at an expert-parallel experts module (``torch.compile``'s
#: graph-break reason, which ``torch_compat.compile_counts()`` lists).
DISPATCH_BREAK = ("expert parallel: the token all-to-all's splits are the routing's row counts, data-dependent "
                  "sizes a graph cannot hold; the dispatch, local experts and combine run eagerly")


def parallelize_experts(module: nn.Module, ep_mesh: DeviceMesh, *, fqn: str = "") -> nn.Module:
    """Divide ``module``'s stacked experts over ``ep_mesh`` (its first dim is EP; a second one, TP,
    holds them replicated) and route its forward through the token all-to-all; returns ``module``.

    Every parameter of ``module`` must stack ``E`` experts on dim 0, ``E`` divisible by the EP size.
    Its weights may be plain tensors or ``Replicate`` DTensors (what ``parallelize_module`` made of
    them); ``fqn`` names the module in errors. Example::

        parallelize_experts(model.model.layers[0].mlp.experts, mesh["EP"])
    """
    ep = ep_mesh.size(0)
    stacked = _stacked_params(module, ep, fqn)
    placements = [Shard(0)] + [Replicate()] * (ep_mesh.ndim - 1)
    coordinate = ep_mesh.get_coordinate()[0]
    for name, param in stacked.items():
        full = _whole(param, f"{fqn}.{name}")
        # a meta model (cost.parallelize_on_meta) stays on meta: shapes only
        local = split_tensor(Shard(0), full, ep)[coordinate].detach().clone().to("meta" if full.is_meta else ep_mesh.device_type)
        dt = DTensor.from_local(local, ep_mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
        own_parameters(module)[name] = nn.Parameter(dt, requires_grad=param.requires_grad)
    num_experts = next(iter(stacked.values())).shape[0]
    # the routing keeps the names only: holding ``stacked`` would keep every expert's whole weights alive
    module._expert_routing = ExpertRouting(fqn, tuple(stacked), num_experts, ep, ep_mesh.get_group(0))
    module.__class__ = _routed_class(type(module))
    return module


@dataclass(frozen=True)
class ExpertRouting:
    """What an expert-parallel experts module routes with (held by the module, shared by its copies)."""

    fqn: str
    names: tuple[str, ...]
    """Its stacked parameters' names."""
    num_experts: int
    ep: int
    group: dist.ProcessGroup

    def __deepcopy__(self, memo: dict) -> ExpertRouting:
        return self  # (immutable; a process group is not copied)


@torch.compiler.disable(reason=DISPATCH_BREAK)
def _routed_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward over EP: dispatch, the module's own forward on its local experts, combine.
    Kept out of torch.compile's graph (``DISPATCH_BREAK``): one function for every experts module, so a
    compiled block's cache entry serves every layer."""
    route: ExpertRouting = module._expert_routing
    # under tensor parallel the block hands in Replicate DTensors: every TP rank routes the same tokens
    layout = (hidden_states.device_mesh, hidden_states.placements) if isinstance(hidden_states, DTensor) else None
    hidden_states, top_k_index, top_k_weights = (_replicated_local(t, route.fqn) for t in
                                                 (hidden_states, top_k_index, top_k_weights))
    rows, local_ids, routing = dispatch(hidden_states, top_k_index, route.num_experts, route.group)
    unit = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
    with _local_experts(module, list(route.names), route.num_experts // route.ep):
        # the module's own forward: the class's below the routed one (a wrapper's class may sit above it)
        routed = next(c for c in type(module).__mro__ if c.__dict__.get("forward") is _routed_forward)
        out = super(routed, module).forward(rows, local_ids.unsqueeze(-1), unit)
    out = combine(out, top_k_weights, routing)
    return out if layout is None else DTensor.from_local(out, *layout, run_check=False)


@functools.cache
def _routed_class(cls: type) -> type:
    """``cls`` with the routed forward: the module's class becomes it, as FSDP2's ``fully_shard`` makes
    its own (one per class; the module's name, methods and ``isinstance`` stay)."""
    return type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _routed_forward})


@register_patch(EXPERT_PATCH)
def expert_parallel(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Patch: :func:`parallelize_experts` over the ``"EP"`` dim of the mesh ``device_mesh`` belongs
    to (``parallelize_module`` hands patches its ``"TP"`` dim, or ``"EP"`` on a mesh without TP)."""
    parallelize_experts(module, expert_mesh(device_mesh, fqn), fqn=fqn)


def expert_mesh(device_mesh: DeviceMesh, fqn: str = "") -> DeviceMesh:
    """The mesh experts live on: the ``"EP"`` dim of ``device_mesh``'s root mesh, with its ``"TP"``
    dim beside it where it has one of more than one rank (experts are replicated over TP)."""
    root = root_mesh(device_mesh)
    names = tuple(root.mesh_dim_names or ())
    if EXPERT_DIM not in names:
        raise ValueError(f"{EXPERT_PATCH} on {fqn!r}: the mesh has dims {list(names)} and no {EXPERT_DIM!r} dim to "
                         f"divide the experts over; parallelize over a mesh with one, e.g. dims ('DP', 'EP')")
    if "TP" in names and root["TP"].size() > 1:
        return root[(EXPERT_DIM, "TP")]
    return root if names == (EXPERT_DIM,) else root[EXPERT_DIM]


def _stacked_params(module: nn.Module, ep: int, fqn: str) -> dict[str, nn.Parameter]:
    """The module's own parameters, each stacking the same number of experts on dim 0, which EP divides."""
    params = {name: p for name, p in module.named_parameters(recurse=False)}
    if not params:
        raise ValueError(f"{EXPERT_PATCH} on {fqn!r}: {type(module).__name__} has no parameters of its own; it must "
                         "be the module that stacks the experts' weights (transformers' '...mlp.experts')")
    counts = {name: p.shape[0] if p.ndim >= 2 else None for name, p in params.items()}
    if len(set(counts.values())) != 1 or None in counts.values():
        raise ValueError(f"{EXPERT_PATCH} on {fqn!r}: every parameter must stack the experts on dim 0, one count "
                         f"for all; got {[(n, tuple(p.shape)) for n, p in params.items()]}")
    num_experts = next(iter(counts.values()))
    if num_experts % ep:
        raise ValueError(f"{EXPERT_PATCH} on {fqn!r}: {num_experts} experts do not divide over {ep} EP ranks; pick an "
                         f"EP size that divides {num_experts}")
    return params


def _replicated_local(t: torch.Tensor, fqn: str) -> torch.Tensor:
    """A plain tensor as is; a DTensor's local tensor, which must be the whole value (``Replicate``)."""
    if not isinstance(t, DTensor):
        return t
    if not all(p.is_replicate() for p in t.placements):
        raise ValueError(f"{EXPERT_PATCH} on {fqn!r}: the experts take every token whole on each tensor-parallel "
                         f"rank, got a DTensor {list(t.placements)}; plan the MoE block's input [[Replicate()]]")
    return t.to_local()


def _whole(param: torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(param, DTensor):
        if not all(p.is_replicate() for p in param.placements):
            raise ValueError(f"{EXPERT_PATCH}: {name!r} is {list(param.placements)}; experts are divided over EP "
                             "from whole weights: leave them out of the plan's parameter section (Replicate)")
        return local_tensor(param)
    return param


@contextlib.contextmanager
def _local_experts(module: nn.Module, names: list[str], num_local: int) -> Iterator[None]:
    """While the module's own forward runs: its stacked weights are this rank's experts as plain
    tensors (``to_local``, so their grads flow back to the DTensor parameters), and ``num_experts``
    (if it has one) counts them, as every implementation of transformers' experts reads it."""
    saved = {name: own_parameters(module)[name] for name in names}
    count = module.__dict__.get("num_experts")
    try:
        for name, param in saved.items():
            own_parameters(module)[name] = param.to_local()
        if count is not None:
            module.num_experts = num_local
        yield
    finally:
        own_parameters(module).update(saved)
        if count is not None:
            module.num_experts = count
