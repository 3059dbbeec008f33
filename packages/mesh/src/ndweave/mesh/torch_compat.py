"""Every private torch API ndweave uses, in one place.

torch keeps some things we need behind underscores: a DTensor's local shard without an autograd
node, ``_StridedShard``, the chunking DTensor itself uses, the local shape/offset of a shard, mesh
flattening, the fake process group's store, the autograd engine's end-of-backward callback, fake
tensors and pytrees, whether a tensor is a view, the tracker of live tensor bytes, a module's own
parameter and buffer dicts, an optimizer's state-dict hooks, the buffers torch's pipeline stage infers
shapes on, CPU's flash attention, torch.compile's counters. Packages and the job reach them from here, never from torch
directly, so a torch release that moves one breaks one file, and ``tests/mesh/test_mesh_torch_compat.py``
says which. ``PRIVATE_TORCH`` names each one this module uses, and why;
``tests/mesh/test_mesh_private_torch.py`` reads every package and the job and fails on a private torch
name used anywhere else, or used here and not in ``PRIVATE_TORCH`` (or listed and no longer used).

The tests pin each against the installed torch (2.13 in CI); the floor in the packages'
``pyproject.toml`` (2.11) is the oldest release ndweave has run on (the CUDA machine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.utils.dlpack
from torch._subclasses.fake_tensor import (  # noqa: F401  (re-exported)
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._functional_collectives import AsyncCollectiveTensor as _AsyncCollectiveTensor
from torch.distributed._functional_collectives import all_gather_single as _all_gather_single
from torch.distributed._functional_collectives import all_reduce as _all_reduce
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed._functional_collectives import reduce_scatter_single as _reduce_scatter_single
from torch.distributed._functional_collectives import wait_tensor as _wait_tensor
from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout, _world
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset, compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: F401  (re-exported)

__all__ = [
    "CompileCounts",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "adopt_mesh_state",
    "all_to_all_single",
    "dtensor_lacks_backward_rule",
    "flash_attention_cpu",
    "flash_attention_cpu_backward",
    "flash_attention_cpu_ops",
    "gather_on",
    "gather_traced",
    "non_persistent_buffer_names",
    "op_schema",
    "optimizer_load_state_dict_hooks",
    "optimizer_state_dict_hooks",
    "own_buffers",
    "own_parameters",
    "own_submodules",
    "reduce_scatter_on",
    "reduce_scatter_traced",
    "sum_on",
    "takes_flash_attention",
    "FakeTensor",
    "FakeTensorMode",
    "MemTracker",
    "TensorMemory",
    "StridedShard",
    "TorchDispatchMode",
    "chunk_sizes",
    "compile_counts",
    "compiled_backward_retained",
    "compiled_in_place",
    "holds_compiled_code",
    "reset_compile_counts",
    "is_compiled_wrapper",
    "current_backward_id",
    "custom_chunk",
    "dtensor_of",
    "default_store",
    "drop_mesh_state",
    "dtensor_over",
    "own_storage_view",
    "fake_store",
    "find_group",
    "group_device_types",
    "group_timeout",
    "flatten_dense_tensors",
    "flatten_mesh",
    "flatten_state_dict",
    "is_shard_like",
    "is_view",
    "local_shape_and_offset",
    "local_shape_at",
    "live_groups",
    "local_tensor",
    "mesh_without_groups",
    "queue_backward_callback",
    "root_mesh",
    "set_group_timeout",
    "split_indices",
    "split_tensor",
    "storage_id",
    "torch_function_disabled",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unflatten_dense_tensors",
]

#: Every private torch API this module uses, each with what it is for here, under the name
#: ``tests/mesh/test_mesh_private_torch.py`` gives it: a dotted path (``DeviceMesh(_init_backend=)``: a
#: private keyword) or ``Class.member`` for a member of a torch object. The test keeps it exact.
PRIVATE_TORCH: dict[str, str] = {
    "torch._dynamo.eval_frame.OptimizedModule": "torch.compile(module)'s wrapper, which prefixes FQNs with "
                                                "'_orig_mod.' (is_compiled_wrapper)",
    "torch._dynamo.utils.counters": "what torch.compile did (frames, graphs, graph breaks): no public API "
                                    "counts them (compile_counts)",
    "torch._dynamo.utils.guard_failures": "why torch.compile compiled again, naming the input (compile_counts)",
    "torch._functorch.config": "AOT autograd's settings: donated buffers (compiled_backward_retained)",
    "torch._functorch.config.patch": "donated_buffer off while a split backward compiles (compiled_backward_retained)",
    # re-exported: torch has no public home for fake tensors, pytrees and dispatch modes
    "torch._subclasses.fake_tensor.FakeTensor": "FakeTensor: shapes without memory (deferred init, estimates)",
    "torch._subclasses.fake_tensor.FakeTensorMode": "FakeTensorMode: the mode that makes them",
    "torch._subclasses.fake_tensor.DataDependentOutputException": "DataDependentOutputException: an op whose "
                                                                  "output needs values fake tensors lack",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException": "DynamicOutputShapeException: likewise, its shape",
    "torch.utils._pytree.tree_flatten": "tree_flatten: the leaves of nested args and their structure",
    "torch.utils._pytree.tree_unflatten": "tree_unflatten: the structure rebuilt around new leaves",
    "torch.utils._pytree.tree_map": "tree_map: a function applied to every leaf",
    "torch.utils._pytree.tree_leaves": "tree_leaves: the leaves of nested values",
    "torch.utils._python_dispatch.TorchDispatchMode": "TorchDispatchMode: the base of dispatch modes that "
                                                      "record or count ops",
    # tensors, DTensors and placements
    "torch._utils._flatten_dense_tensors": "flatten_dense_tensors: tensors copied into one flat tensor",
    "torch._utils._unflatten_dense_tensors": "unflatten_dense_tensors: its inverse, as views",
    "Tensor._is_view": "is_view: pipelining detach_()es stage outputs, which autograd refuses for a view",
    "Tensor/UntypedStorage._cdata": "storage_id: a storage's address, which tells meta storages apart",
    "DTensor._local_tensor": "local_tensor, dtensor_over: the local shard with no autograd node",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": "dtensor_of: a DTensor's mesh, placements and shape",
    "torch.distributed.tensor._dtensor_spec.TensorMeta": "dtensor_of: its global shape, stride and dtype",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator": "dtensor_lacks_backward_rule: which "
                                                                           "aten ops DTensor has a rule for",
    "torch.distributed.tensor.placement_types._StridedShard": "StridedShard: a fused weight's pieces, each sharded",
    "torch.distributed.tensor.Shard._custom_chunk": "custom_chunk: a dim cut as Shard cuts it",
    "Shard/_StridedShard._split_tensor": "split_tensor: every rank's piece under one placement",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": "local_shape_and_offset (a public "
                                                                             "name in a private module)",
    "torch.distributed.tensor._utils._compute_local_shape_and_global_offset": "local_shape_at: the same with no mesh",
    "torch.distributed.checkpoint._nested_dict.flatten_state_dict": "flatten_state_dict: DCP's keys for a state dict",
    # meshes and process groups
    "DeviceMesh._flatten": "flatten_mesh: one 1-D mesh over every rank of a mesh",
    "DeviceMesh._get_root_mesh": "root_mesh: the mesh a sub-mesh was sliced from",
    "torch.distributed.device_mesh.DeviceMesh(_init_backend=)": "mesh_without_groups: a mesh a rank outside it "
                                                                "can hold",
    "torch.distributed._functional_collectives.all_to_all_single_autograd": "all_to_all_single: uneven rows "
                                                                            "moved, with autograd, traceable",
    "torch.distributed._functional_collectives.all_gather_single": "gather_traced: an all-gather a trace on meta "
                                                                   "records with its group's name",
    "torch.distributed._functional_collectives.reduce_scatter_single": "reduce_scatter_traced: likewise",
    "torch.distributed._functional_collectives.all_reduce": "sum_on: the all-reduce DTensor's Partial -> "
                                                            "Replicate runs",
    "torch.distributed._functional_collectives.wait_tensor": "gather_on, reduce_scatter_on, sum_on: waited for",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor": "likewise: what may need the wait",
    "torch.distributed.distributed_c10d._get_default_store": "default_store: the default group's store",
    "torch.distributed.distributed_c10d._set_pg_timeout": "set_group_timeout: a mesh group's timeout",
    "ProcessGroup._get_backend": "group_timeout: the group's backend for a device",
    "Backend.Options._timeout": "group_timeout: that backend's collective timeout",
    "ProcessGroup._device_types": "group_device_types: the devices a group has a backend for",
    "torch.distributed.distributed_c10d._world": "live_groups, find_group: torch's registry of live groups",
    "torch.distributed.distributed_c10d._abort_process_group": "abort_group: a group aborted and unregistered",
    "torch.testing._internal.distributed.fake_pg.FakeStore": "fake_store: the store of the fake process group",
    # autograd and dispatch
    "torch._C._current_graph_task_id": "current_backward_id: one backward pass told from the next",
    "torch.autograd.Variable._execution_engine.queue_callback": "queue_backward_callback: a callback at the "
                                                                "end of backward",
    "torch._C.DisableTorchFunction": "torch_function_disabled: an analysis's own calls hidden from a trace",
    "OpOverload._schema": "op_schema: an op's arguments (which ops take a generator)",
    # modules, optimizers and pipelining
    "Module._compiled_call_impl": "compiled_in_place: set by module.compile() (compiled in place)",
    "Module._parameters": "own_parameters: a module's parameter slots, set without __setattr__'s checks",
    "Module._buffers": "own_buffers: likewise its buffers",
    "Module._modules": "own_submodules: likewise its children",
    "Module._non_persistent_buffers_set": "non_persistent_buffer_names: buffers left out of state_dict()",
    "Optimizer._optimizer_state_dict_pre_hooks": "optimizer_state_dict_hooks: a wrapper's state_dict() runs them",
    "Optimizer._optimizer_state_dict_post_hooks": "optimizer_state_dict_hooks: likewise",
    "Optimizer._optimizer_load_state_dict_pre_hooks": "optimizer_load_state_dict_hooks: a wrapper's "
                                                      "load_state_dict() runs them",
    "Optimizer._optimizer_load_state_dict_post_hooks": "optimizer_load_state_dict_hooks: likewise",
    "PipelineStage._to_tensor": "PipelineStageBase.shape_inference_buffer: the buffers shape inference runs on",
    "torch.distributed._tools.mem_tracker.MemTracker": "MemTracker, TensorMemory: live tensor bytes per device",
    "MemTracker._fake_mode_on_entry": "TensorMemory: MemTracker's __enter__ without its module tracker",
    "MemTracker._track_resize": "TensorMemory: likewise",
    "MemTracker._restore_resize": "TensorMemory: likewise",
    "MemTracker._peak_mem": "TensorMemory.reset_peak",
    "MemTracker._peak_mem_snap": "TensorMemory.reset_peak",
    # attention: what a kernel saves, for estimates and FLOP counts
    "torch._fused_sdp_choice": "takes_flash_attention: the kernel sdpa picks for given inputs",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": "flash_attention_cpu(_ops): CPU's flash kernel",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": "flash_attention_cpu_ops, "
                                                                           "flash_attention_cpu_backward: its backward",
    "torch.ops.aten._scaled_dot_product_flash_attention": "flash_attention_cpu_ops: CUDA's twin of the same math",
    "torch.ops.aten._scaled_dot_product_flash_attention_backward": "flash_attention_cpu_ops: its backward",
}

#: ``all_to_all_single(rows, output_splits, input_splits, group)``: the rows moved (uneven splits),
#: with autograd (its backward is the reverse move) and as a functional collective, so a trace on
#: meta tensors runs it and a dispatch mode sees it with its group's name. torch's public autograd
#: version (``torch.distributed.nn.functional``) is deprecated in favour of this one.
all_to_all_single = all_to_all_single_autograd


def gather_traced(tensor: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated on dim 0, as a functional collective: on meta tensors over a
    fake world (an estimate's trace) it runs, and a dispatch mode (``ndweave.plan.work.WorkCounter``)
    sees it with its group's name, where ``dist``'s in-place collectives show neither."""
    return _all_gather_single(tensor, 0, group)


def reduce_scatter_traced(tensor: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over the ranks, this rank's equal part of dim 0, as :func:`gather_traced` is run."""
    return _reduce_scatter_single(tensor, "sum", 0, group)


def gather_on(tensor: torch.Tensor, dim: int, group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated on ``dim`` (counted from the front), waited for: the
    functional collective DTensor's ``Shard(dim) -> Replicate`` runs, so the same bits, without
    DTensor's planning around it."""
    return _waited(_all_gather_single(tensor.contiguous(), dim, group))


def reduce_scatter_on(tensor: torch.Tensor, dim: int, group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over the ranks, this rank's equal part of ``dim``, waited for (DTensor's
    ``Partial -> Shard(dim)``)."""
    return _waited(_reduce_scatter_single(tensor.contiguous(), "sum", dim, group))


def sum_on(tensor: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over the ranks into a new tensor, waited for (DTensor's ``Partial -> Replicate``)."""
    return _waited(_all_reduce(tensor, "sum", group))


def _waited(t: torch.Tensor) -> torch.Tensor:
    return _wait_tensor(t) if isinstance(t, _AsyncCollectiveTensor) else t


#: ``_StridedShard(dim, split_factor=f)``: the dim is cut into ``f`` pieces, each piece is sharded
#: over the ranks, and rank r holds the concatenation of its share of each piece (a fused
#: [q | k | v] weight where rank r holds [q_r | k_r | v_r]). Not a ``Shard`` subclass in 2.13.
StridedShard = _StridedShard


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself, no autograd node, unlike ``to_local()``), or ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_of(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
               shape: Sequence[int], stride: Sequence[int]) -> DTensor:
    """A DTensor over ``local`` (its piece under ``placements`` of a tensor of ``shape`` and
    ``stride``), built with no autograd node and no check: ``DTensor.from_local`` without its Python
    autograd function, which costs ~60 us of CPU a call (torch 2.13). For an autograd function of
    one's own that computes on local shards and hands DTensors in and out. Its spec is built once per
    layout and shared (building one runs DTensor's shard-order checks on every field set)."""
    key = (id(mesh), placements, tuple(shape), tuple(stride), local.dtype)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= 4096:  # shapes that keep changing: start over rather than grow
            _SPECS.clear()
        # (the spec holds the mesh: its id cannot name another mesh while the entry lives)
        spec = _SPECS[key] = DTensorSpec(mesh, placements,
                                         tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


_SPECS: dict[tuple, DTensorSpec] = {}


def is_shard_like(p: Placement) -> bool:
    """``Shard`` or ``_StridedShard``: the placement holds a part of tensor dim ``p.dim``."""
    return isinstance(p, (Shard, _StridedShard))


def custom_chunk(t: torch.Tensor, num_chunks: int, dim: int) -> list[torch.Tensor]:
    """``t`` cut into ``num_chunks`` pieces along ``dim`` exactly as DTensor's ``Shard`` cuts it
    (first pieces largest, empty pieces at the end when the dim is short)."""
    return list(Shard._custom_chunk(t, num_chunks, dim=dim))


def split_tensor(placement: Placement, t: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """Every rank's piece of ``t`` under one ``Shard``/``_StridedShard`` placement (views, unpadded)."""
    return list(placement._split_tensor(t, num_chunks, with_padding=False, contiguous=False)[0])


def split_indices(placement: Placement, indices: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """Every rank's piece of the 1-D ``indices`` (positions along the placement's tensor dim) under one
    ``Shard``/``_StridedShard`` placement: which of those positions each rank keeps, in local order."""
    on_dim0 = type(placement)(0, split_factor=placement.split_factor) if isinstance(placement, _StridedShard) else Shard(0)
    return split_tensor(on_dim0, indices, num_chunks)


def chunk_sizes(placement: Placement, size: int, num_chunks: int) -> list[int]:
    """Sizes of the pieces ``split_tensor`` makes of a dim of ``size`` elements."""
    return [len(piece) for piece in split_indices(placement, torch.arange(size), num_chunks)]


def local_shape_and_offset(global_shape: Sequence[int], mesh: DeviceMesh,
                           placements: Sequence[Placement]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_shape, global_offset)`` of this rank's shard, as DTensor computes them. The offset is
    only meaningful without ``_StridedShard`` (a strided shard is not one block)."""
    shape, offset = compute_local_shape_and_global_offset(tuple(global_shape), mesh, list(placements))
    return tuple(shape), tuple(offset)


def local_shape_at(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                   placements: Sequence[Placement]) -> tuple[int, ...]:
    """The local shape DTensor gives the rank at ``coordinate`` of a mesh of ``mesh_shape`` (uneven
    and ``_StridedShard`` pieces included), with no mesh or process group: what an estimate of a
    layout not yet launched needs (``_compute_local_shape_and_global_offset``)."""
    shape, _ = _compute_local_shape_and_global_offset(tuple(global_shape), tuple(mesh_shape), list(coordinate),
                                                      list(placements), skip_offset=True)
    return tuple(shape)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over every rank of ``mesh``, registered under ``name`` (``DeviceMesh._flatten``)."""
    return mesh._flatten(name)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced (or flattened) from, itself if none (``DeviceMesh._get_root_mesh``):
    how a patch handed ``mesh["TP"]`` finds the mesh's other dims (``"EP"``)."""
    return mesh._get_root_mesh()


def flatten_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """``(flat, paths)``: a nested state dict flattened exactly as DCP flattens it on save (keys
    joined by dots; lists entered only where they hold tensors or dicts), and each flat key's path
    of keys and list indices. A loader must flatten its destination the same way to meet DCP's keys."""
    # imported here: torch.distributed.checkpoint costs a third of a second to import
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten

    return dcp_flatten(state_dict)


def set_group_timeout(group: torch.distributed.ProcessGroup, timeout: timedelta) -> None:
    """Give an existing process group another collective timeout (``_set_pg_timeout``): torch's
    ``DeviceMesh`` creates its dim groups with the backend's default timeout, not the default group's.
    Only gloo and NCCL take one (torch's fake backend, say, has none to set)."""
    if any(name in str(torch.distributed.get_backend(group)) for name in ("gloo", "nccl")):
        _set_pg_timeout(timeout, group)


def group_timeout(group: torch.distributed.ProcessGroup, device_type: str | None = None) -> timedelta | None:
    """The collective timeout of ``group``'s backend for ``device_type`` (default: the group's first
    device type; its options' ``_timeout``), or ``None`` where the backend does not say."""
    try:
        device_type = device_type or group_device_types(group)[0]
        return group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, IndexError, RuntimeError):
        return None


def group_device_types(group: torch.distributed.ProcessGroup) -> list[str]:
    """The device types ``group`` has a backend for (``ProcessGroup._device_types``), e.g. ``["cpu"]``."""
    return [d.type for d in group._device_types]


def live_groups() -> list[torch.distributed.ProcessGroup]:
    """Every process group this rank belongs to, the default one included, in the order they were
    created (torch's registry ``_world.pg_names``): the same order on every rank of a group."""
    return list(_world.pg_names)


def find_group(description: str) -> torch.distributed.ProcessGroup | None:
    """The live process group created with ``group_desc=description``, looked up in torch's own
    registry of groups (``_world.pg_names``), so that a group made once for a purpose is found again
    without a registry of ours."""
    for group in list(_world.pg_names):
        if getattr(group, "group_desc", None) == description:
            return group
    return None


def current_backward_id() -> int:
    """An id of the backward pass running now (``_current_graph_task_id``; -1 outside backward):
    hooks that fire once per tensor tell one backward pass from the next by it."""
    return torch._C._current_graph_task_id()


def default_store() -> torch.distributed.Store:
    """The store the default process group was created on (``_get_default_store``)."""
    return _get_default_store()


def fake_store() -> torch.distributed.Store:
    """The store torch's ``"fake"`` process group runs on; importing it registers that backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (what torch's DDP does at its end)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def torch_function_disabled() -> contextlib.AbstractContextManager:
    """A context in which torch calls skip every ``TorchFunctionMode`` (``DisableTorchFunction``): code
    of an analysis running inside a traced forward (a hook) is not recorded as the model's."""
    return torch._C.DisableTorchFunction()


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (``Tensor._is_view``): autograd refuses to
    ``detach_()`` one, which torch's pipelining does to stage outputs."""
    return t._is_view()


def storage_id(t: torch.Tensor) -> int:
    """An id of the storage ``t`` keeps alive, shared by its views and unique while it lives
    (``UntypedStorage._cdata``, the storage's own address): unlike ``data_ptr()`` it tells meta
    tensors' storages apart too (their data pointers are all 0)."""
    return t.untyped_storage()._cdata


def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` back to back (a copy)."""
    return _flatten_dense_tensors(list(tensors))


def unflatten_dense_tensors(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like`` (the inverse of :func:`flatten_dense_tensors`)."""
    return list(_unflatten_dense_tensors(flat, list(like)))



def adopt_mesh_state(target: DeviceMesh, source: DeviceMesh) -> tuple[str, ...]:
    """Make ``target`` (a ``DeviceMesh`` subclass instance that skipped ``DeviceMesh.__init__``) the
    same mesh as ``source``; return the attribute names taken. A ``DeviceMesh`` keeps its whole state
    in instance attributes; they are shared, not copied, so the two compare equal, hash alike, and
    share process groups and flattened meshes."""
    state = vars(source)
    vars(target).update(state)
    return tuple(state)


def drop_mesh_state(target: DeviceMesh, names: Sequence[str]) -> None:
    """Undo :func:`adopt_mesh_state` (``names`` is what it returned)."""
    for name in names:
        vars(target).pop(name, None)


def mesh_without_groups(device_type: str, ranks: Sequence, mesh_dim_names: Sequence[str]) -> DeviceMesh:
    """A ``DeviceMesh`` describing ``ranks`` without creating process groups (``_init_backend=False``):
    what a rank outside that mesh can hold of it (creating groups is collective over the world)."""
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(mesh_dim_names), _init_backend=False)


def own_storage_view(view: torch.Tensor) -> torch.Tensor:
    """A tensor over ``view``'s memory at offset 0 of a storage of its own (through DLPack, which keeps
    ``view``'s storage alive): writes through either are seen by both, yet nothing tells it is part of
    a larger buffer. A DTensor's wrapper takes its local tensor's storage offset, and two things in
    torch need the two to agree with a local tensor that lives at an offset in a flat buffer (ZeRO's
    parameters, DDP's published grads): ``Tensor.__deepcopy__`` (a wrapper at a nonzero offset is
    read as a real tensor: "invalid python storage") and dynamo's fake tensors (a mismatch takes the
    ``set_`` path ``meta_utils`` cannot run on a wrapper subclass: "set the storage of a tensor on
    device cpu to a storage on different device meta"). Devices without DLPack (meta) get ``view``
    back."""
    if view.storage_offset() == 0 or view.device.type == "meta":
        return view
    try:
        return torch.utils.dlpack.from_dlpack(view.detach())
    except (RuntimeError, TypeError, BufferError):  # a backend without DLPack: the view itself
        return view


@torch.no_grad()
def dtensor_over(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                 shape: Sequence[int], stride: Sequence[int], *, compilable: bool = False) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)`` whose local tensor
    shares ``local``'s memory (a view of a flat buffer stays one, in memory), with no autograd node.

    ``DTensor.from_local`` on a view at a storage offset gives the wrapper that offset too, which
    neither deep-copies nor compiles (:func:`own_storage_view`). Built at offset 0 with its local
    tensor re-pointed at ``local``'s storage and offset, it deep-copies. ``compilable``: over the same
    memory at offset 0 of a storage of its own instead (where the device has DLPack), which also
    compiles, while a tracker of live storages (``TensorMemory``) counts that memory once more."""
    shared = own_storage_view(local) if compilable else local
    if shared.storage_offset() == 0:
        return DTensor.from_local(shared, mesh, list(placements), run_check=False, shape=tuple(shape),
                                  stride=tuple(stride))
    base = local.new_empty(0).set_(local.untyped_storage(), 0, local.shape, local.stride())
    out = DTensor.from_local(base, mesh, list(placements), run_check=False, shape=tuple(shape), stride=tuple(stride))
    out._local_tensor.set_(local.untyped_storage(), local.storage_offset(), local.shape, local.stride())
    return out


def own_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The parameters registered on ``module`` itself by name (not its children's; ``None`` where one
    was registered as ``None``): torch's own dict (``Module._parameters``), so what is set in it takes
    the parameter's place without ``nn.Module.__setattr__``'s checks (a DTensor parameter, or a plain
    tensor for the length of a forward)."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The buffers registered on ``module`` itself by name: torch's own dict (``Module._buffers``), as
    :func:`own_parameters`."""
    return module._buffers


def own_submodules(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """The children of ``module`` by name: torch's own dict (``Module._modules``), so a child set in it
    is replaced without ``nn.Module.__setattr__``'s checks."""
    return module._modules


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """The names of ``module``'s own buffers left out of its ``state_dict()`` (``persistent=False``;
    ``Module._non_persistent_buffers_set``, torch's own set)."""
    return module._non_persistent_buffers_set


def dtensor_lacks_backward_rule(op_name: str) -> bool:
    """Whether autograd runs ``aten.<op_name>`` as itself and its backward ``aten.<op_name>_backward``
    too (neither decomposed: ``linear``'s backward is ``mm``'s), and DTensor has no sharding rule for that
    backward (``avg_pool2d``, ``hardswish``): on DTensors the forward runs and the backward raises, so a
    patch runs such an op on local tensors instead. False where there is no such op."""
    ops = [getattr(getattr(torch.ops.aten, name, None), "default", None) for name in (op_name, f"{op_name}_backward")]
    if None in ops or any(op.has_kernel_for_dispatch_key("CompositeImplicitAutograd") for op in ops):
        return False
    propagator = DTensor._op_dispatcher.sharding_propagator
    return not any(ops[1] in table for table in (propagator.op_strategy_funcs, propagator.op_to_rules,
                                                 propagator.op_single_dim_strategy_funcs))


def op_schema(func: Callable) -> torch.FunctionSchema | None:
    """The schema of the op a dispatch mode is handed (``OpOverload._schema``: its arguments), ``None``
    for what has none (a higher-order operator)."""
    return getattr(func, "_schema", None)


def optimizer_state_dict_hooks(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``(pre, post)``: the hooks registered with ``optimizer.register_state_dict_pre_hook`` and
    ``register_state_dict_post_hook``, by handle id (torch's own dicts, ``_optimizer_state_dict_*_hooks``):
    what an optimizer with its own ``state_dict()`` runs around it, as torch's does."""
    return optimizer._optimizer_state_dict_pre_hooks, optimizer._optimizer_state_dict_post_hooks


def optimizer_load_state_dict_hooks(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``(pre, post)``: the hooks registered with ``optimizer.register_load_state_dict_pre_hook`` and
    ``register_load_state_dict_post_hook`` (``_optimizer_load_state_dict_*_hooks``), as
    :func:`optimizer_state_dict_hooks`."""
    return optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks


def takes_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                          attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                          enable_gqa: bool = False) -> bool:
    """Whether ``F.scaled_dot_product_attention`` picks the flash kernel for these inputs on their
    device (``torch._fused_sdp_choice``, which asks the kernels' own checks)."""
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                     enable_gqa=enable_gqa)
    return choice == SDPBackend.FLASH_ATTENTION.value


def flash_attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                        is_causal: bool = False, *, attn_mask: torch.Tensor | None = None,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, logsumexp)`` of CPU's flash attention kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu``): it has a meta kernel and a backward, saves
    the output and its log-sum-exp (not the T x T weights), and takes grouped keys as they are."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def flash_attention_cpu_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool = False, *,
                                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_query, grad_key, grad_value)`` of :func:`flash_attention_cpu` (no dropout) given the output
    and log-sum-exp its softmax normalizes by: with those of attention over more keys than ``key``
    (merged blocks), each block's share of the gradient."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)


def flash_attention_cpu_ops() -> dict[Callable, Callable]:
    """CPU's flash attention ops, forward and backward, each mapped to CUDA's flash attention op of the
    same math (torch's FLOP counter has formulas for the CUDA ones only)."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward}


# ---------------------------------------------------------------------------------------------------
# For ndweave.pipeline: torch's pipelining stage, and aborting a process group. One block, named in
# ``__all__`` here, apart from the rest of the module.
# ---------------------------------------------------------------------------------------------------
__all__ += ["PIPELINE_STAGE_OVERRIDES", "PipelineStageBase", "abort_group", "pipeline_stage_kwargs"]

#: The ``PipelineStage`` methods ``ndweave.pipeline``'s stage overrides, with the parameters it takes
#: and passes on, in order. Names without a documented contract (torch's schedules call them; one is
#: private), so the tests pin them against the installed torch.
PIPELINE_STAGE_OVERRIDES: dict[str, tuple[str, ...]] = {
    "forward_one_chunk": ("fwd_chunk_id", "args", "kwargs", "save_forward_output"),
    "backward_one_chunk": ("bwd_chunk_id", "loss", "full_backward", "last_backward"),
    "backward_weight_one_chunk": ("bwd_chunk_id", "last_backward"),
    "backward_maybe_with_nosync": ("backward_type", "bwd_kwargs", "last_backward"),
    "_to_tensor": ("arg",),  # private, overridden by PipelineStageBase: the shape inference's buffers
}

#: torch's ``PipelineStage`` whose shape inference's buffers pass through a public method,
#: ``shape_inference_buffer(arg, tensor)``: torch makes one (``_to_tensor``) for each input the stage
#: receives from another (``arg``: the input, or its metadata), in uninitialized memory; a subclass may
#: fill it, and returns the buffer (by default as it is). Built on first use (see ``__getattr__``):
#: torch.distributed.pipelining takes seconds to import.
PipelineStageBase: type


def pipeline_stage_kwargs(get_mesh: Callable) -> dict[str, Callable]:
    """The keyword arguments of ``PipelineStage(...)`` that only some torch releases take:
    ``get_mesh`` (how a stage finds a received DTensor activation's mesh) is newer than torch 2.11."""
    import inspect

    # imported here: torch.distributed.pipelining takes seconds to import
    from torch.distributed.pipelining import PipelineStage

    return {"get_mesh": get_mesh} if "get_mesh" in inspect.signature(PipelineStage.__init__).parameters else {}


def abort_group(group: torch.distributed.ProcessGroup) -> None:
    """Abort ``group``, remove it from torch's registries (``_abort_process_group``), and put a group
    of this rank alone in its place.

    NCCL aborts the group's communicators. gloo's abort does nothing (torch 2.13): its connections
    close when the group object is freed, so the caller drops its own references too (a peer waiting
    on a receive from this rank then fails at once, "Connection closed by peer"). The one-rank group
    keeps torch's count of live groups where it was: torch names a group its ranks make alone
    (``use_local_synchronization=True``) after those ranks and that count, so the next one over the
    same ranks would get the aborted group's name, and its stale rendezvous keys in the store."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group(group)
    torch.distributed.new_group([torch.distributed.get_rank()], use_local_synchronization=True,
                                group_desc="ndweave:aborted-group-placeholder")


def __getattr__(name: str):
    # torch's memory tracker loads on first use: its package (torch.distributed._tools) imports FSDP,
    # the activation-checkpointing and runtime estimators and more, which a rank that never measures
    # memory should not carry; the pipeline stage base too (torch.distributed.pipelining: seconds)
    if name in ("MemTracker", "TensorMemory"):
        globals().update(_memory_tracker())
        return globals()[name]
    if name == "PipelineStageBase":
        globals()[name] = _pipeline_stage_base()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _pipeline_stage_base() -> type:
    """``PipelineStageBase``, built on first use (see ``__getattr__``)."""
    from torch.distributed.pipelining import PipelineStage

    class PipelineStageBase(PipelineStage):
        """torch's ``PipelineStage``, its shape inference's buffers passed through
        :meth:`shape_inference_buffer`."""

        def _to_tensor(self, arg):
            return self.shape_inference_buffer(arg, super()._to_tensor(arg))

        def shape_inference_buffer(self, arg, tensor: torch.Tensor) -> torch.Tensor:
            """The buffer shape inference runs the stage on for ``arg`` (a received input, or its
            metadata): ``tensor``, uninitialized, to be filled or returned as it is."""
            return tensor

    PipelineStageBase.__qualname__ = "PipelineStageBase"
    return PipelineStageBase


def _memory_tracker() -> dict[str, type]:
    """``MemTracker`` and ``TensorMemory``, built on first use (see ``__getattr__``)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class TensorMemory(MemTracker):
        """Live tensor bytes per device while active (a context manager): ``ndweave.mesh.testing.memory``."""

        def __enter__(self) -> TensorMemory:
            # MemTracker's own __enter__ also starts its module tracker, whose backward hooks
            # (register_multi_grad_hook) fail inside the autograd.grad a pipeline stage runs; the
            # totals need only the dispatch mode and the storage-resize patch, started here
            self._fake_mode_on_entry = None  # eager: ops under DTensor's propagation fake mode are skipped
            self._track_resize()
            self.reset_peak()
            TorchDispatchMode.__enter__(self)
            return self

        def __exit__(self, *args) -> None:
            self._restore_resize()
            TorchDispatchMode.__exit__(self, *args)

        def current_bytes(self, device: str | torch.device = "cpu") -> int:
            """Bytes of live tensors on ``device`` now."""
            return self._total(self.get_tracker_snapshot("current"), device)

        def peak_bytes(self, device: str | torch.device = "cpu") -> int:
            """The most bytes of live tensors on ``device`` at once since the start (or the last
            :meth:`reset_peak`)."""
            return self._total(self.get_tracker_snapshot("peak"), device)

        def reset_peak(self) -> None:
            """From here on the peak starts at what is live now."""
            self._peak_mem_snap = self.get_tracker_snapshot("current")
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}

        @staticmethod
        def _total(snapshot: dict, device: str | torch.device) -> int:
            return int(snapshot.get(torch.device(device), {}).get("Total", 0))

    TensorMemory.__qualname__ = "TensorMemory"
    return {"MemTracker": MemTracker, "TensorMemory": TensorMemory}


@dataclass(frozen=True)
class CompileCounts:
    """What ``torch.compile`` did in this process since :func:`reset_compile_counts` (dynamo's counters)."""

    frames: int
    """Python frames dynamo converted: each a first compile or a recompile."""
    graphs: int
    """FX graphs it handed to the backend (a frame with graph breaks makes several)."""
    graph_breaks: dict[str, int]
    """Each graph break's reason and how often it was met."""
    recompiles: tuple[str, ...] = ()
    """Why compiled code was compiled again: each failed guard, naming the input (``tensor 'x' size
    mismatch at index 1. expected 4, actual 5``)."""

    def break_reasons(self) -> list[str]:
        """Each graph break's reason in one line: its first, or the reason given to
        ``torch.compiler.disable`` where a function was kept out of the graph on purpose."""
        short = []
        for text in self.graph_breaks:
            given = text.partition("(reason: ")[2]
            short.append(given.rpartition(")")[0] if given else text.splitlines()[0])
        return short


def compile_counts() -> CompileCounts:
    """``torch.compile``'s counts since :func:`reset_compile_counts` (``torch._dynamo.utils.counters``,
    and ``guard_failures``: why it compiled again)."""
    from torch._dynamo.utils import counters, guard_failures

    failed = tuple(reason.partition(": ")[2] or reason for reasons in guard_failures.values() for reason in reasons)
    return CompileCounts(frames=counters["frames"]["total"], graphs=counters["stats"]["unique_graphs"],
                         graph_breaks=dict(counters["graph_break"]), recompiles=failed)


@contextlib.contextmanager
def compiled_backward_retained():
    """Within it, a module ``torch.compile`` compiles gets a backward that may run with
    ``retain_graph=True`` (no donated buffers): a zero-bubble pipeline schedule's input-grad backward
    keeps the graph for its weight-grad backward, which a compiled backward with donated buffers
    refuses ("compiled with non-empty donated buffers which requires ... retain_graph=False")."""
    import torch._functorch.config

    with torch._functorch.config.patch(donated_buffer=False):
        yield


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` compiled ``module`` in place; a plain attribute read, cheap enough
    for a per-forward check (unlike :func:`is_compiled_wrapper`, whose import costs ~20x)."""
    return module._compiled_call_impl is not None


def holds_compiled_code(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs compiled: compiled in place (``module.compile()``) or ``torch.compile``'s
    wrapper (its submodules not searched)."""
    return compiled_in_place(module) or is_compiled_wrapper(module)


def is_compiled_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(m)``'s wrapper (``OptimizedModule``, holding ``m`` as
    ``_orig_mod``); ``m.compile()`` compiles in place and makes none."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def reset_compile_counts() -> None:
    """Start :func:`compile_counts` from zero (what was compiled stays compiled)."""
    from torch._dynamo.utils import counters, guard_failures

    counters.clear()
    guard_failures.clear()
