"""``parallelize_module``: turn an ``nn.Module`` into a DModule following a sharding plan.

Order of work (each step sees the result of the previous one):

1. parameters and buffers become DTensors: planned ones per the plan, the rest ``Replicate``
   (from a ``deferred_init`` module only the local shards are ever allocated), except unplanned
   non-persistent buffers, which stay plain tensors on the mesh's device;
2. patches run (by FQN regex or ``class:<Name>``): they see distributed parameters and may replace
   ``forward``;
3. forward resharding hooks are installed (inputs, outputs, weights);
4. the root's class is swapped for its DModule subclass.

On a mesh with an ``"EP"`` dim the plan's ``expert_parallel`` patches divide experts over it
(``experts/parallel.py``); without a ``"TP"`` dim too, tensor parallelism has one rank: every tensor
stays a plain tensor and only those patches run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ndweave.dmodule.deferred_init import is_deferred, replay, storage_key, take_program
from ndweave.dmodule.dmodule import DModuleState, make_dmodule
from ndweave.dmodule.experts.parallel import EXPERT_DIM, EXPERT_PATCH, expert_parallel
from ndweave.dmodule.factory import FactoryArg, install_factory
from ndweave.dmodule.hooks import install_forward_hooks, install_local_output_hook
from ndweave.dmodule.linear import use_local_linears
from ndweave.dmodule.patches import patch_name, resolve_patch
from ndweave.dmodule.plan import check_placements, match_modules, names_removed_module, no_match_error
from ndweave.dmodule.relayout import contiguous_stride
from ndweave.dmodule.sharded import sharded_global_shapes
from ndweave.dmodule.spec import IO_LEAVES, PlacementSpec, Plan, normalize_plan, plan_specs, split_key
from ndweave.mesh import DEVICE_MESH, ParallelMesh, resolve_mesh
from ndweave.mesh.agree import agree_or_raise
from ndweave.mesh.torch_compat import (FakeTensor, StridedShard, custom_chunk, is_compiled_wrapper,
                                        non_persistent_buffer_names, own_buffers, own_parameters, split_tensor)

__all__ = ["parallelize_module"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | ParallelMesh | None,
    sharding_plan: Mapping[str, Mapping] | None = None,
    *,
    param_sharding_plan: Mapping[str, Any] | None = None,
    fwd_resharding_plan: Mapping[str, Any] | None = None,
    is_model_sharded: bool = False,
    factory: FactoryArg = False,
    patches: Mapping[str, Any] | None = None,
    use_local_output: bool = True,
) -> nn.Module:
    """Distribute ``module`` over ``device_mesh`` per the plan; return it, now a :class:`DModule`.

    - ``device_mesh``: a ``DeviceMesh`` of any ndim (nD TP: one placement per mesh dim), a
      ``ParallelMesh`` (its ``"TP"`` dim; one without is an error), or ``None`` (the default mesh's
      ``"TP"``). A mesh with an ``"EP"`` dim (``("DP", "EP")``, ``("DP", "EP", "TP")``): tensor
      parallel over its ``"TP"`` dim, experts over ``"EP"`` by the plan's ``expert_parallel``
      patches; without a ``"TP"`` dim every tensor stays plain and only those patches run.
    - ``sharding_plan``: ``{"parameter": {...}, "forward": {...}, "patch": {...}}``;
      ``param_sharding_plan`` / ``fwd_resharding_plan`` / ``patches`` are merged into its sections.
      Keys are ``<regex fully matching a module FQN>.<leaf>``; see the package README.
    - ``is_model_sharded``: the module's tensors already are this rank's local shards.
    - Buffers the plan does not name become ``Replicate`` DTensors, except non-persistent ones
      (caches such as RoPE tables), which stay plain tensors on the mesh's device.
    - ``factory``: tensors the forward creates (``torch.zeros``, ``arange``, ...) are DTensors:
      ``True`` (``Replicate``, in the root's forward), or veScale's per-class form
      ``{ModuleClass: True | False | {torch.zeros: [placements], ...}}`` (the innermost class wins).
    - ``use_local_output``: the root module's outputs that are fully replicated DTensors (anywhere in
      a tuple, list, dict, dataclass or HF ``ModelOutput``) come back as plain tensors, so
      ``loss_fn(model(x), y)`` works with a plain target, as under torch's tensor parallel. Sharded
      and ``Partial`` outputs stay DTensors (a plain local shard would silently meet a full target).
      ``False``: every output stays as the plan left it.

    Example (the seed's MLP)::

        dmlp = parallelize_module(mlp, mesh,
            param_sharding_plan={"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)],
                                 "fc2.weight": [Shard(1)], "fc2.bias": [Replicate()]},
            fwd_resharding_plan={"fc1.input": [[Replicate()]], "fc2.output": [[Replicate()]]})
        loss = F.mse_loss(dmlp(x), y)            # a plain tensor: fc2's output is Replicate
        loss.backward()
        dmlp.finish_grad_sync()
    """
    return _parallelize(module, device_mesh, sharding_plan, param_sharding_plan, fwd_resharding_plan,
                        is_model_sharded, factory, patches, use_local_output, on_meta=False)


def _parallelize(module: nn.Module, device_mesh: DeviceMesh | ParallelMesh | None, sharding_plan: Any,
                 param_sharding_plan: Any, fwd_resharding_plan: Any, is_model_sharded: bool, factory: FactoryArg,
                 patches: Any, use_local_output: bool, *, on_meta: bool) -> nn.Module:
    """:func:`parallelize_module`; ``on_meta=True`` (``cost.parallelize_on_meta``, shapes only): a
    model on meta becomes meta DTensors with this rank's local shapes instead of an error."""
    _check_arguments(module, sharding_plan, param_sharding_plan, fwd_resharding_plan, patches,
                     is_model_sharded, use_local_output)
    mesh, tensor_parallel = _resolve(device_mesh)

    def validate() -> tuple[tuple[Plan, list[_Layout], _PatchTargets], dict[str, Any]]:
        plan = normalize_plan(sharding_plan, param_sharding_plan, fwd_resharding_plan, patches)
        _check_experts_planned(device_mesh, plan)
        layouts = _choose_layouts(module, mesh, plan.parameter if tensor_parallel else {}, is_model_sharded,
                                  keep_plain=not tensor_parallel, on_meta=on_meta)
        targets = _patch_targets(module, plan.patch)
        if not tensor_parallel:  # tensor parallel over one rank changes nothing: only experts move
            targets = [t for t in targets if getattr(t[2], "func", t[2]) is expert_parallel]
        return (plan, layouts, targets), _fingerprint(plan, layouts, is_model_sharded, factory, use_local_output)

    # every check that needs no communication runs first, then the ranks agree on the outcome, so a
    # mistake on one rank (a plan or model that differs by rank) raises on all instead of a hang
    (plan, layouts, targets), local_shapes = agree_or_raise(mesh, "parallelize_module", validate)
    global_shapes = sharded_global_shapes(mesh, layouts, local_shapes) if is_model_sharded else {}
    _distribute_tensors(module, mesh, layouts, global_shapes, "meta" if on_meta else mesh.device_type)
    for fqn, m, patch in targets:
        patch(m, mesh, fqn)
    if tensor_parallel:
        use_local_linears(module)
    factory_mode, factory_handles = install_factory(module, mesh, factory)
    state = DModuleState(mesh=mesh, factory_mode=factory_mode)
    state.hook_handles = (_install_forward_plan(module, mesh, plan.forward) if tensor_parallel else []) + factory_handles
    if use_local_output:
        state.hook_handles.append(install_local_output_hook(module))
    return make_dmodule(module, state)


def _check_arguments(module: Any, sharding_plan: Any, param_sharding_plan: Any, fwd_resharding_plan: Any,
                     patches: Any, is_model_sharded: Any, use_local_output: Any) -> None:
    """The argument types, each error naming the argument and the fix (plans' contents: ``plan.py``)."""
    if isinstance(module, type):
        raise TypeError(f"parallelize_module: module is the class {module.__name__}; pass an instance "
                        f"({module.__name__}(...)) or deferred_init({module.__name__}, ...)")
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module: module must be a torch.nn.Module, got {type(module).__name__}")
    compiled = [name or "<the module itself>" for name, m in module.named_modules() if is_compiled_wrapper(m)]
    if compiled:
        # torch.compile's wrapper holds the module as ``_orig_mod``: the plan's FQNs would miss it
        raise TypeError(f"parallelize_module: {compiled[0]} is torch.compile'd (its FQNs gain '_orig_mod.', which no "
                        "plan names); parallelize first, then compile in place: block.compile() on each block")
    for name, value in (("sharding_plan", sharding_plan), ("param_sharding_plan", param_sharding_plan),
                        ("fwd_resharding_plan", fwd_resharding_plan), ("patches", patches)):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"parallelize_module: {name} must be a dict (or None), got {type(value).__name__}; "
                            "a JSON plan file is read with ndweave.dmodule.load_plan(path)")
    for name, value in (("is_model_sharded", is_model_sharded), ("use_local_output", use_local_output)):
        if not isinstance(value, bool):
            raise TypeError(f"parallelize_module: {name} must be True or False, got {value!r}")


def _resolve(device_mesh: Any) -> tuple[DeviceMesh, bool]:
    """``(the mesh tensors are laid out on, whether it is tensor parallel)``."""
    names = _dim_names(device_mesh)
    if EXPERT_DIM in names:  # experts over "EP" (the patches find it); tensors over "TP", if any
        whole = resolve_mesh(device_mesh)
        # a TP dim of one rank (the GPT job's ("PP", "DP", "EP", "TP") = (2, 2, 2, 1)): no tensor parallel
        if "TP" in names and whole["TP"].size() > 1:
            return whole["TP"], True
        return (whole if names == (EXPERT_DIM,) else whole[EXPERT_DIM]), False
    # a torch DeviceMesh is taken whole (any ndim: nD tensor parallel over all its dims); a
    # ParallelMesh, a DeviceMesh too, is narrowed to its "TP" dim
    if isinstance(device_mesh, DeviceMesh) and not isinstance(device_mesh, ParallelMesh):
        return device_mesh, True
    try:
        return resolve_mesh(device_mesh, "TP"), True
    except KeyError:
        # sharding over every dim of a (DP, PP, ...) mesh is never what was meant: say so
        mesh = DEVICE_MESH if device_mesh is None else device_mesh
        names = list(mesh.mesh_dim_names)
        which = "the default DEVICE_MESH" if device_mesh is None else "the ParallelMesh passed"
        raise ValueError(
            f"parallelize_module: {which} has dims {names} and no 'TP' dim to shard the module over; pass "
            f"the dim to parallelize over, mesh[\"<dim>\"] (e.g. mesh[{names[-1]!r}]), or a DeviceMesh "
            "(used whole: one placement per mesh dim)"
        ) from None


def _dim_names(device_mesh: Any) -> tuple[str, ...]:
    if device_mesh is None:
        return tuple(DEVICE_MESH.mesh_dim_names) if DEVICE_MESH.is_initialized() else ()
    return tuple(device_mesh.mesh_dim_names or ()) if isinstance(device_mesh, DeviceMesh) else ()


def _check_experts_planned(device_mesh: Any, plan: Plan) -> None:
    """A mesh whose ``"EP"`` dim has several ranks needs a plan that divides experts over it: a model
    without experts has nothing to put there (its EP ranks would only duplicate DP's work, unsaid)."""
    names = _dim_names(device_mesh)
    if EXPERT_DIM not in names:
        return
    size = resolve_mesh(device_mesh).size(names.index(EXPERT_DIM))
    if size > 1 and not any(patch_name(e) == EXPERT_PATCH for entries in plan.patch.values() for e in entries):
        raise ValueError(
            f"parallelize_module: the mesh has an {EXPERT_DIM!r} dim of {size} ranks, but the plan divides no experts "
            f"over it (no {EXPERT_PATCH!r} patch in its 'patch' section). Name the module that stacks the experts "
            f"(get_plan(..., expert_parallel=True), or {{'patch': {{'<experts FQN regex>': ['{EXPERT_PATCH}']}}}}); "
            f"a model without experts has no use for an {EXPERT_DIM!r} dim: make those ranks data parallel ('DP')"
        )


# ---------------------------------------------------------------------------------------- parameters
@dataclass
class _Layout:
    """One tensor (tied weights are one) and where it goes: chosen and checked before any collective."""

    tensor: torch.Tensor
    slots: list[tuple[str, nn.Module, str]]
    """Every (fqn, module, leaf) holding it."""
    placements: tuple
    plain: bool
    """An unplanned non-persistent buffer: stays a plain tensor."""

    @property
    def name(self) -> str:
        return self.slots[0][0]

    @property
    def local_shard(self) -> bool:
        """Under ``is_model_sharded=True``: this rank's piece, from which the global tensor is built."""
        return not (self.plain or isinstance(self.tensor, (DTensor, FakeTensor)))


def _choose_layouts(root: nn.Module, mesh: DeviceMesh, param_plan: dict[str, PlacementSpec],
                    is_model_sharded: bool, *, keep_plain: bool = False, on_meta: bool = False) -> list[_Layout]:
    # Every (module, leaf) slot holding each tensor: tied weights share one tensor, hence one plan.
    slots: dict[int, list[tuple[str, nn.Module, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for fqn, m in root.named_modules(remove_duplicate=False):
        for store in (own_parameters(m), own_buffers(m)):
            for leaf, t in store.items():
                if t is not None:
                    slots.setdefault(id(t), []).append((_join(fqn, leaf), m, leaf))
                    tensors[id(t)] = t

    chosen: dict[int, tuple[str, PlacementSpec]] = {}
    for key, spec in param_plan.items():
        regex, leaf = split_key(key)
        hits = [(fqn, m) for fqn, m in match_modules(root, regex, key)
                if own_parameters(m).get(leaf) is not None or own_buffers(m).get(leaf) is not None]
        if not hits:
            if names_removed_module(root, regex):
                continue  # the module is on another pipeline stage
            raise no_match_error("parameter", key, (name for s in slots.values() for name, _, _ in s))
        for fqn, m in hits:
            t = own_parameters(m).get(leaf)
            t = own_buffers(m)[leaf] if t is None else t
            prev = chosen.get(id(t))
            if prev is not None and prev[1].placements != spec.placements and prev[0] != key:
                raise ValueError(
                    f"parameter {_join(fqn, leaf)!r} (shared by {[s[0] for s in slots[id(t)]]}) gets "
                    f"{list(spec.placements)} from {key!r} but {list(prev[1].placements)} from {prev[0]!r}"
                )
            chosen[id(t)] = (key, spec)

    deferred = is_deferred(root)
    replicate = PlacementSpec([Replicate()] * mesh.ndim)
    layouts = []
    for tid, t in tensors.items():
        name = slots[tid][0][0]
        what = f"{'parameter' if isinstance(t, nn.Parameter) else 'buffer'} {name!r}"
        placements = check_placements(chosen.get(tid, (None, replicate))[1], t, mesh, what)
        if isinstance(t, FakeTensor):
            if not deferred:
                raise RuntimeError(f"{what} is a fake tensor: parallelize the module deferred_init returned, not a part of it")
            if any(isinstance(p, Partial) for p in placements):
                raise ValueError(f"{what}: a deferred-init tensor cannot start Partial on {mesh}")
        elif t.is_meta and not on_meta:
            raise ValueError(f"{what} is on the meta device and has no values; build the module with "
                             "deferred_init(module_fn, ...) to get values equal to eager init")
        # An unplanned non-persistent buffer is a cache the model rebuilds from its config (a RoPE
        # table) and combines with whatever its forward computes, often local tensors (local
        # attention heads): it stays a plain tensor, the whole value on every rank.
        plain = keep_plain or (tid not in chosen and _non_persistent_buffer(slots[tid]))
        layouts.append(_Layout(t, slots[tid], placements, plain))
    return layouts


def _fingerprint(plan: Plan, layouts: list[_Layout], is_model_sharded: bool, factory: Any,
                 use_local_output: bool) -> dict[str, Any]:
    """What every rank of the mesh must be given equal (see ``ndweave.mesh.agree.agree_or_raise``), as text."""
    sharded = is_model_sharded
    return {
        "plan": {**{f"parameter[{k!r}]": repr(v) for k, v in plan.parameter.items()},
                 **{f"forward[{k!r}]": repr(v) for k, v in plan.forward.items()},
                 **{f"patch[{k!r}]": _describe(v) for k, v in plan.patch.items()}},
        "arguments": {"is_model_sharded": sharded, "use_local_output": use_local_output,
                      "factory": _describe(factory)},
        # a sharded model's local shapes may differ (uneven shards): gathered and checked, not compared
        "model": {x.name: f"{tuple(x.placements)} {x.tensor.dtype} {x.tensor.ndim if sharded else tuple(x.tensor.shape)}"
                  for x in layouts},
        "local": {x.name: tuple(x.tensor.shape) for x in layouts if x.local_shard} if sharded else None,
    }


def _describe(value: Any) -> str:
    """``value`` as text equal on every rank: functions and classes by name (their repr holds an address)."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_describe(k)}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_describe, value)) + "]"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', None) or ''}.{value.__qualname__}"
    return repr(value)


def _distribute_tensors(root: nn.Module, mesh: DeviceMesh, layouts: list[_Layout],
                        global_shapes: dict[str, torch.Size], device: str) -> None:
    """Each tensor as its layout says, its local values on ``device`` (the mesh's, or meta: shapes only)."""
    program = take_program(root) if is_deferred(root) else None
    targets: dict[int, list[Callable[[torch.Tensor], int]]] = {}  # storage key -> its tensors' installers
    for x in layouts:
        t, placements, plain = x.tensor, x.placements, x.plain

        def install(dt: torch.Tensor, x: _Layout = x) -> None:
            if isinstance(x.tensor, nn.Parameter):
                dt = nn.Parameter(dt, requires_grad=x.tensor.requires_grad)  # one object: ties stay tied
            for _, m, leaf in x.slots:
                (own_parameters(m) if leaf in own_parameters(m) else own_buffers(m))[leaf] = dt

        if isinstance(t, FakeTensor):
            installer = _local_shard_installer(t, mesh, placements, install, plain)
            targets.setdefault(storage_key(t), []).append(installer)
        elif isinstance(t, DTensor):
            install(t if tuple(t.placements) == placements else t.redistribute(mesh, placements))
        elif plain:
            install(t.to(device))
        elif x.name in global_shapes:  # is_model_sharded
            shape = global_shapes[x.name]
            install(DTensor.from_local(t.detach().contiguous().to(device), mesh, placements,
                                       run_check=False, shape=shape, stride=contiguous_stride(shape)))
        else:
            install(distribute_tensor(t.detach().to(device), mesh, placements))
    if program is not None:
        stats = replay(program, targets)
        root.__dict__["_materialize_stats"] = stats


def _non_persistent_buffer(slots: list[tuple[str, nn.Module, str]]) -> bool:
    """Every module holding the tensor has it as a non-persistent buffer (not in its state_dict)."""
    return all(leaf in own_buffers(m) and leaf in non_persistent_buffer_names(m) for _, m, leaf in slots)


def _local_shard_installer(fake: torch.Tensor, mesh: DeviceMesh, placements: tuple,
                           install: Callable[[torch.Tensor], None], plain: bool) -> Callable[[torch.Tensor], int]:
    def take(storage_root: torch.Tensor) -> int:
        full = storage_root.as_strided(fake.size(), fake.stride(), fake.storage_offset())
        local = local_shard(full, mesh, placements)
        if local.numel() * local.element_size() < local.untyped_storage().nbytes():
            # a view (of the full tensor, or of a strided copy a later Shard cut): keep only the shard
            # so the rest is freed; a whole-storage replica or a fresh strided copy is kept as is
            local = local.clone()
        local = local.contiguous().to(mesh.device_type)
        install(local if plain else DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                                                       stride=contiguous_stride(full.shape)))
        return local.numel() * local.element_size()

    return take


def local_shard(full: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> torch.Tensor:
    """This rank's shard of ``full``: what ``distribute_tensor(full, mesh, placements)`` leaves on it,
    bit for bit, but with no communication and no full-size copy (deferred init replays the full
    tensor on every rank already; a scatter would only move what each rank has).

    Mesh dims are applied left to right, as ``distribute_tensor`` does. ``Shard`` keeps a view (torch's
    own chunking). ``_StridedShard``'s rank pieces are not one block (rank r of ``split_factor=3``
    holds [q_r | k_r | v_r]): torch's ``_StridedShard._split_tensor`` chunks the dim into
    ``split_factor`` pieces, chunks each over the ranks and concatenates piece r of each; we do the
    same for this rank alone, with torch's own chunking, so one ``cat`` copies just the shard (torch's
    would ``cat`` every rank's shard: a second full-size tensor).
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: no shard (as distribute_tensor)
        return full.new_empty(0)
    local = full
    for mesh_dim, p in enumerate(placements):
        n, r = mesh.size(mesh_dim), coordinate[mesh_dim]
        if isinstance(p, Shard):
            local = split_tensor(p, local, n)[r]
        elif isinstance(p, StridedShard):
            pieces = custom_chunk(local, p.split_factor, dim=p.dim)
            local = torch.cat([custom_chunk(piece, n, dim=p.dim)[r] for piece in pieces], dim=p.dim)
    return local


# ---------------------------------------------------------------------------------------- patches
_PatchTargets = list[tuple[str, nn.Module, Callable[[nn.Module, DeviceMesh, str], None]]]


def _patch_targets(root: nn.Module, patch_plan: dict[str, list]) -> _PatchTargets:
    """Every (fqn, module, patch) the plan's patch section applies, in plan order; found and checked
    before any collective (a patch runs later, on distributed parameters)."""
    targets = []
    for key, patches in patch_plan.items():
        if key.startswith("class:"):
            cls_name = key[len("class:"):]
            hits = [(fqn, m) for fqn, m in root.named_modules() if type(m).__name__ == cls_name]
            if not hits and not names_removed_module(root, key):
                raise no_match_error("patch", key, ("class:" + type(m).__name__ for m in root.modules()))
        else:
            hits = match_modules(root, key)
            if not hits and not names_removed_module(root, key):
                raise no_match_error("patch", key, (fqn for fqn, _ in root.named_modules()))
        fns = [resolve_patch(p, f"patch[{key!r}]") for p in patches]
        targets += [(fqn, m, fn) for fqn, m in hits for fn in fns]
    return targets


# ---------------------------------------------------------------------------------------- forward
def _install_forward_plan(root: nn.Module, mesh: DeviceMesh, fwd_plan: dict[str, Any]) -> list:
    per_module: dict[int, tuple[str, nn.Module, dict[str, Any]]] = {}
    for key, value in fwd_plan.items():
        regex, leaf = split_key(key)
        hits = match_modules(root, regex, key)
        if leaf not in IO_LEAVES:
            hits = [(f, m) for f, m in hits
                    if own_parameters(m).get(leaf) is not None or own_buffers(m).get(leaf) is not None]
        if not hits:
            if names_removed_module(root, regex):
                continue  # the module is on another pipeline stage
            candidates = [_join(f, x) for f, m in root.named_modules() for x in (*IO_LEAVES, *own_parameters(m))]
            raise no_match_error("forward", key, candidates)
        _check_forward_value(key, value, mesh)
        for fqn, m in hits:
            per_module.setdefault(id(m), (fqn, m, {}))[2][leaf] = value
    handles = []
    for fqn, m, entries in per_module.values():
        handles += install_forward_hooks(m, fqn, mesh, entries)
    return handles


def _check_forward_value(key: str, value: Any, mesh: DeviceMesh) -> None:
    for spec in plan_specs(value):
        if len(spec.placements) != mesh.ndim:
            raise ValueError(
                f"forward plan {key!r}: {len(spec.placements)} placements {list(spec.placements)} for a "
                f"{mesh.ndim}-D mesh {mesh}; give one placement per mesh dim"
            )


def _join(fqn: str, leaf: str) -> str:
    return f"{fqn}.{leaf}" if fqn else leaf
