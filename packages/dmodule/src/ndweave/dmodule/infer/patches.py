"""The patches automatic plans name, each taking JSON arguments (``{"name": ..., "args": {...}}``).

- ``fused_colwise(pieces=k)``: a projection whose output the model cuts into ``k`` equal pieces
  (``[q | k | v]``, ``[gate | up]``), its parameters laid out ``_StridedShard(dim, split_factor=k)``
  by the plan: it runs the module's own forward on the local parameters and hands on the plain
  local ``[piece_0,r | ... | piece_k-1,r]``, so the model's own split gives this rank's pieces.
  Works for any module type (``nn.Linear``, GPT-2's ``Conv1D``, ...): it swaps the parameters.
- ``tp_divides(sizes=[...])``: refuses a tensor-parallel size that does not divide every sharded
  size of a block (its heads), naming the module; an uneven cut would split a head. The zoo names
  its sizes (``sizes={"n_head": 12}``) or reads them off the module when the patch runs
  (``attributes=["config.num_key_value_heads"]``), so the error names the config field.
- ``replicated_local()``: a module whose parameters are all replicated (attention the plan could not
  shard, an MoE router and its experts) runs its forward on plain local tensors: its DTensor
  arguments, parameters and buffers are handed in as local tensors and its tensor outputs come back
  ``Replicate`` DTensors. Every rank computes the same thing, with no communication, whatever ops
  the forward uses (DTensor has no rule for some: ``nonzero``, ``topk`` on indices, ...) and
  whatever plain tensors it meets (rotary tables, masks).
- ``replicate_plain()``: on the root (``get_plan("auto")`` writes it there): a plain tensor the model
  computes or is given (positions, masks, rotary tables, pixel values, an adapter's plain branch)
  that meets a DTensor in a torch call is converted at that call, ``DTensor.from_local(t, mesh,
  [Replicate()])``: every rank holds it whole (differentiable: its gradient comes back whole, any
  partial sum reduced). A call DTensor has no rule for (a boolean mask index, ``unique``), or none
  for its backward (pooling, ``hardswish``), runs on the whole values as local tensors (``Replicate``
  out, the same on every rank; a shard gathered first). Scoped to the root's forward (a
  ``TorchFunctionMode``, never process-global, above autograd); the first forward that converts
  nothing turns it off for good, so a model whose plan hands every value over itself (the decoder
  LMs) pays one forward of checks and nothing after.
- ``local_block(partial=[...])``: a module whose column- and row-wise linears run inside its own
  forward (experts as 3-D weights): it runs whole on this rank's shards; its inputs are handed in
  whole (their gradients partial sums, reduced on the way back), its parameters as local shards, and
  each tensor it returns comes back a ``Partial`` DTensor (``partial[i]``: a row-wise partial sum,
  reduced by the plan's output entry) or a ``Replicate`` one.
- ``pointwise_local()``: a module that works on each position of a sharded dim apart (a norm on the
  sequence-parallel stream: its statistics are over features, never over the sequence) runs on this
  rank's shard as plain tensors: its input's local tensor in, its replicated parameters as local
  tensors whose gradient is this rank's partial sum (as DTensor makes it), and its output back as a
  DTensor laid out as the input was. The same values as through DTensor, with none of its ops inside
  (a Llama RMSNorm forward and backward: ~16 of them). Any other input (a ``Partial`` one, a second
  DTensor) runs through DTensor as before.
- ``partial_grad_params(names=[...])``: parameters of a module that works on this rank's heads
  inside a sharded block (a norm over each head's features: Qwen3's ``q_norm``) are handed to its
  forward as local tensors whose gradient is this rank's partial sum (``finish_grad_sync()`` sums
  them), so they meet the plain local heads.
- ``vocab_parallel_forward()``: ``vocab_parallel_embedding`` for an embedding whose own forward does
  more than the lookup (scales it: Gemma's ``embed_scale``): that forward runs on this rank's rows
  (ids outside them point at an extra zero row) and its output is the ``Partial`` sum the plan
  reduces. The planner has checked that the forward is linear in the lookup.
- ``divide_attributes(names=[...])``: divides int attributes (``"num_heads"``,
  ``"config.num_attention_heads"``) by the tensor-parallel size, for forwards that reshape with a
  literal head count. An attribute of a shared object (a config) is changed on a copy owned by this
  module, so other modules keep theirs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.overrides import TorchFunctionMode

from ndweave.dmodule.relayout import from_local, through_dtensor, to_local
from ndweave.dmodule.patches import register_patch
from ndweave.mesh.torch_compat import (StridedShard, dtensor_lacks_backward_rule, own_buffers, own_parameters, tree_flatten,
                                       tree_map, tree_unflatten)

__all__ = ["divide_attributes", "fused_colwise", "local_block", "partial_grad_params", "pointwise_local",
           "replicate_plain", "replicated_local", "tp_divides", "vocab_parallel_forward"]


def _tp_size(device_mesh: DeviceMesh, fqn: str, what: str) -> int:
    if device_mesh.ndim != 1:
        raise ValueError(f"{fqn}: {what} is for a 1-D tensor-parallel mesh, not {device_mesh}")
    return device_mesh.size()


@register_patch("tp_divides")
def tp_divides(module: nn.Module, device_mesh: DeviceMesh, fqn: str, *, sizes: list[int] | dict[str, int] = (),
               attributes: list[str] = ()) -> None:
    """Refuse a mesh whose size does not divide every one of ``sizes`` (a list, or a dict naming
    each size for the error: ``{"n_head": 12}``) and every int attribute of ``module`` named in
    ``attributes`` (dotted paths read when the patch runs, for a plan written without the model at
    hand: ``["config.num_attention_heads", "config.num_key_value_heads"]``; one set to ``None``, an
    unset optional count, is skipped)."""
    tp = _tp_size(device_mesh, fqn, "tp_divides")
    named = dict(sizes) if isinstance(sizes, dict) else {}
    for path in attributes:
        value = functools.reduce(getattr, path.split("."), module)
        if value is None:
            continue
        if not isinstance(value, int):
            raise ValueError(f"{fqn}.{path} = {value!r}: tp_divides checks int counts (heads, features)")
        named[path] = value
    unnamed = [] if isinstance(sizes, dict) else list(sizes)
    bad = [s for s in unnamed if s % tp]
    if bad:
        raise ValueError(f"{fqn}: the plan splits its heads / features in pieces of sizes {unnamed}; the {tp} ranks of "
                         f"{device_mesh} do not divide {bad} (a head would be cut): use a tensor-parallel size "
                         f"dividing {math.gcd(*unnamed)}")
    bad_named = [f"{name}={value}" for name, value in named.items() if value % tp]
    if bad_named:
        listed = [f"{name}={value}" for name, value in named.items()]
        must = {1: "must", 2: "must both"}.get(len(listed), "must all")
        raise ValueError(f"{fqn}: {' and '.join(listed)} {must} be divisible by the tensor-parallel size {tp} "
                         f"({device_mesh}); {' and '.join(bad_named)} {'does' if len(bad_named) == 1 else 'do'} not "
                         f"split over the {tp} ranks (a head would be cut): use a tensor-parallel size dividing "
                         f"{math.gcd(*named.values())}")


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
        with _as_local([(own_parameters(module), name) for name in params]):
            return forward(module, x, *args, **kwargs)

    module.forward = local_forward


@register_patch("replicated_local")
def replicated_local(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Run ``module`` on plain local tensors (see the module docstring)."""
    tensors = _replicated_dtensors(module, fqn, "replicated_local")
    _run_locally(module, device_mesh, tensors, lambda flat: [False] * len(flat), partial_grad=False)


@register_patch("pointwise_local")
def pointwise_local(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Run ``module`` on its input's local shard (see the module docstring)."""
    tensors = _replicated_dtensors(module, fqn, "pointwise_local")
    forward = type(module).forward

    def local_forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        # a plain or Partial input, one on a mesh of other dims, a second DTensor, or dtensor_linears():
        # through DTensor
        if through_dtensor() or not isinstance(x, DTensor) or x.device_mesh.ndim != device_mesh.ndim \
                or any(p.is_partial() for p in x.placements) \
                or any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
            return forward(module, x, *args, **kwargs)
        local = to_local(x)  # (its gradient comes back laid out as x)
        # each rank's parameter gradient sums over its own positions only: partial over the sharded dims
        with _as_local(tensors, [Partial() if p.is_shard() else Replicate() for p in x.placements]):
            out = forward(module, local, *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"pointwise_local on {fqn!r}: the forward returned a {type(out).__name__}; the patch is "
                            "for modules returning one tensor laid out as their input (a norm)")
        if out.shape != local.shape or not out.is_contiguous():
            return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
        # the input's global shape (an uneven last shard included), so no size is gathered
        return from_local(out, x.device_mesh, tuple(x.placements), shape=x.shape)

    module.forward = local_forward


class _ReplicatePlain(TorchFunctionMode):
    """Converts the plain tensor operands of a torch call that also takes a DTensor to ``Replicate``
    DTensors on that DTensor's mesh (0-d ones are left: DTensor takes them as scalars itself); runs a
    call on the whole values, locally, where DTensor has no rule for it or for its backward
    (``local``: the functions found so, kept across calls)."""

    def __init__(self, local: dict[Any, bool]) -> None:
        super().__init__()
        self.converted = 0
        self.local = local

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        mesh = next((x.device_mesh for x in flat if isinstance(x, DTensor)), None)
        if mesh is None:
            return func(*args, **kwargs)
        if any(_plain(x) for x in flat):
            self.converted += 1
            replicate = [Replicate()] * mesh.ndim
            flat = [DTensor.from_local(x, mesh, replicate, run_check=False) if _plain(x) else x for x in flat]
            args, kwargs = tree_unflatten(flat, spec)
        if _in_place(func) or any(isinstance(x, DTensor) and x.device_mesh != mesh for x in flat):
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") == "mean" and _over_shards(args, kwargs):
            # DTensor's mean over a sharded dim is a Partial(avg), whose backward meets the Partial(sum)
            # gradients of the stream and fails: the sum over those dims, divided, is the same mean
            self.converted += 1
            x, dims, keepdim, dtype = _mean_args(args, kwargs)
            count = math.prod(x.shape[d] for d in dims)
            return torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype) / count
        if len({p.reduce_op for x in flat if isinstance(x, DTensor) for p in x.placements if p.is_partial()}) > 1:
            # a mean over the sequence-sharded stream (Partial(avg)) meeting a Partial(sum), which DTensor
            # cannot convert into each other: both reduced first
            self.converted += 1
            flat = [_reduced(x) if isinstance(x, DTensor) else x for x in flat]
            args, kwargs = tree_unflatten(flat, spec)
        if func not in self.local:
            name = getattr(func, "__name__", "")  # (1-d pooling runs as 2-d: avg_pool1d's backward is avg_pool2d's)
            self.local[func] = any(map(dtensor_lacks_backward_rule, {name, name.replace("1d", "2d")}))
        if getattr(func, "__name__", "") in _SPATIAL and not all(p.is_replicate() for x in flat
                                                                  if isinstance(x, DTensor) for p in x.placements):
            self.converted += 1  # (DTensor's convolution of a sharded image halo-exchanges for one layout only)
            return _run_local(func, flat, spec, mesh)
        if self.local[func] and torch.is_grad_enabled() and any(x.requires_grad for x in flat if isinstance(x, DTensor)):
            self.converted += 1
            return _run_local(func, flat, spec, mesh)
        try:
            return func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):  # (no rule for the op itself: a data-dependent one)
            try:
                out = _run_local(func, flat, spec, mesh)
            except Exception:  # noqa: BLE001 (not DTensor's doing: the original error is the one to see)
                pass
            else:
                self.converted += 1
                return out
            raise


def _mean_args(args: tuple, kwargs: dict) -> tuple[Any, list[int], bool, Any]:
    """``(x, dims, keepdim, dtype)`` of a ``mean`` call (``x.mean()``, ``x.mean(1, keepdim=True)``, ...)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis"))  # (numpy's name works too)
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dims = list(range(x.ndim)) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    return x, [d % x.ndim for d in dims], keepdim, kwargs.get("dtype")


def _over_shards(args: tuple, kwargs: dict) -> bool:
    """Whether a ``mean`` call reduces a DTensor over a dim it is sharded on."""
    if not args or not isinstance(args[0], DTensor) or (len(args) > 1 and not isinstance(args[1], (int, list, tuple))):
        return False
    x, dims, _, _ = _mean_args(args, kwargs)
    return any(p.is_shard() and p.dim % x.ndim in dims for p in x.placements)


# convolutions: a sequence-sharded stream reshaped into an image (patch merging between stages) is
# sharded along its height, which DTensor's convolution does not take (it halo-exchanges a width shard)
_SPATIAL = frozenset(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"))


def _reduced(x: DTensor) -> DTensor:
    if not any(p.is_partial() for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("__") or name in ("__setitem__", "__iadd__", "__imul__")


def _run_local(func: Any, flat: list, spec: Any, mesh: DeviceMesh) -> Any:
    """``func`` on the whole values of its DTensors (each made ``Replicate``: a shard gathered, a partial
    sum reduced), its tensors returned ``Replicate``: the same on every rank, differentiable (a partial
    gradient coming back is summed on the way in, as at any ``Replicate`` boundary)."""
    replicate = [Replicate()] * mesh.ndim
    local = [x.redistribute(mesh, replicate).to_local(grad_placements=replicate) if isinstance(x, DTensor) else x
             for x in flat]
    args, kwargs = tree_unflatten(local, spec)
    out = func(*args, **kwargs)
    return tree_map(lambda t: DTensor.from_local(t, mesh, replicate, run_check=False)
                    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t, out)


def _plain(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() > 0


@register_patch("replicate_plain")
def replicate_plain(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Run ``module``'s forward converting plain tensors that meet DTensors (see the module docstring)."""
    forward = module.forward  # (bound: another patch may have replaced it already)
    state = {"on": True, "first": True}
    local: dict[Any, bool] = {}  # function -> whether it runs on local tensors (no DTensor rule)

    def converting_forward(*args: Any, **kwargs: Any) -> Any:
        if not state["on"]:
            return forward(*args, **kwargs)
        mode = _ReplicatePlain(local)
        with mode:
            out = forward(*args, **kwargs)
        if state["first"]:  # (a model that needed it once keeps it: a later call may take another branch)
            state["on"], state["first"] = mode.converted > 0, False
        return out

    def gathering_forward(*args: Any, **kwargs: Any) -> Any:
        return _gather_sequence(converting_forward(*args, **kwargs))

    module.forward = gathering_forward


def _gather_sequence(output: Any) -> Any:
    """``output`` with every DTensor sharded on a dim other than its last (the sequence, under SP) or
    ``Partial`` made whole (``Replicate``); a shard on the last dim (logits over the vocabulary for
    ``loss_parallel``) is left as it is."""
    def leaf(x: Any) -> Any:
        if isinstance(x, DTensor) and any(p.is_partial() or p.is_shard() and p.dim % x.ndim != x.ndim - 1
                                          for p in x.placements):
            return x.redistribute(x.device_mesh, [p if p.is_shard() and p.dim % x.ndim == x.ndim - 1 else Replicate()
                                                  for p in x.placements])
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {f.name: _gather_sequence(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
            if any(v is not getattr(x, k) for k, v in changes.items()):
                return dataclasses.replace(x, **changes)
        return x
    return tree_map(leaf, output)


@register_patch("local_block")
def local_block(module: nn.Module, device_mesh: DeviceMesh, fqn: str, *, partial: list[bool]) -> None:
    """Run ``module`` on this rank's shards of its parameters (see the module docstring)."""
    _tp_size(device_mesh, fqn, "local_block")
    _run_locally(module, device_mesh, _dtensors(module), lambda flat: partial, partial_grad=True)


@register_patch("partial_grad_params")
def partial_grad_params(module: nn.Module, device_mesh: DeviceMesh, fqn: str, *, names: list[str]) -> None:
    """Hand ``module``'s parameters ``names`` to its forward as local tensors with partial gradients."""
    for name in names:
        p = own_parameters(module).get(name)
        if not isinstance(p, DTensor) or any(not isinstance(q, Replicate) for q in p.placements):
            raise ValueError(f"partial_grad_params on {fqn!r}: {name} must be a replicated DTensor parameter, "
                             f"not {getattr(p, 'placements', p)!r}")
    forward = type(module).forward

    def local_forward(*args: Any, **kwargs: Any) -> Any:
        with _as_local([(own_parameters(module), name) for name in names], grad=[Partial()] * device_mesh.ndim):
            return forward(module, *args, **kwargs)

    module.forward = local_forward


@register_patch("vocab_parallel_forward")
def vocab_parallel_forward(module: nn.Module, device_mesh: DeviceMesh, fqn: str) -> None:
    """Run an ``nn.Embedding`` subclass's own forward on this rank's rows (see the module docstring)."""
    from ndweave.dmodule.plans.vocab_parallel import vocab_parallel_embedding  # the zoo's: checks and row range

    vocab_parallel_embedding(module, device_mesh, fqn)
    start, stop = module.vocab_range
    padding = module.padding_idx
    forward = type(module).forward

    def local_forward(ids: torch.Tensor, *args: Any, **kwargs: Any) -> DTensor:
        ids = ids.full_tensor() if isinstance(ids, DTensor) else ids
        outside = (ids < start) | (ids >= stop)
        weight = module.weight.to_local()
        # ids outside this rank's rows look up an extra zero row: the forward's lookup stays one call
        local_ids = torch.where(outside, torch.full_like(ids, stop - start), ids - start)
        extended = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])
        module.padding_idx = padding - start if padding is not None and start <= padding < stop else None
        try:
            with _replaced(own_parameters(module), "weight", extended):
                out = forward(module, local_ids, *args, **kwargs)
        finally:
            module.padding_idx = padding
        return DTensor.from_local(out, device_mesh, [Partial()], run_check=False)

    module.forward = local_forward


@contextmanager
def _replaced(table: dict, name: str, value: torch.Tensor) -> Iterator[None]:
    saved = table[name]
    table[name] = value
    try:
        yield
    finally:
        table[name] = saved


def _dtensors(module: nn.Module) -> list[tuple[dict, str]]:
    """(table, name) of every DTensor parameter and buffer in ``module``'s subtree."""
    return [(table, name) for m in module.modules() for table in (own_parameters(m), own_buffers(m))
            for name, t in table.items() if isinstance(t, DTensor)]


def _replicated_dtensors(module: nn.Module, fqn: str, patch: str) -> list[tuple[dict, str]]:
    """``_dtensors(module)``, refused unless every one is replicated (what ``patch`` is for)."""
    tensors = _dtensors(module)
    for table, name in tensors:
        if any(not isinstance(p, Replicate) for p in table[name].placements):
            raise ValueError(f"{patch} on {fqn!r}: {name} is laid out {table[name].placements}; the patch is "
                             "for modules whose tensors are all replicated")
    return tensors


def _run_locally(module: nn.Module, mesh: DeviceMesh, tensors: list[tuple[dict, str]],
                 partial: Callable[[list], list[bool]], partial_grad: bool) -> None:
    """Replace ``module.forward``: DTensor arguments handed in whole and plain, ``tensors`` local,
    each tensor output back as a DTensor, ``Partial`` where ``partial(outputs)`` says so, else
    ``Replicate``."""
    forward = type(module).forward

    def local_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(lambda x: _to_local(x, mesh, partial_grad=partial_grad), (args, kwargs))
        with _as_local(tensors):
            out = forward(module, *args, **kwargs)
        flat, spec = tree_flatten(out)
        flags = iter(partial(flat))
        flat = [DTensor.from_local(x, mesh, [Partial() if next(flags, False) else Replicate()] * mesh.ndim,
                                   run_check=False) if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                for x in flat]
        return tree_unflatten(flat, spec)

    module.forward = local_forward


def _to_local(x: Any, mesh: DeviceMesh, partial_grad: bool = False) -> Any:
    """``x`` whole as a plain tensor; with ``partial_grad`` its gradient is this rank's partial sum
    (reduced on the way back), for inputs of a computation each rank does a share of."""
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        if not (partial_grad and x.requires_grad):
            return x
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)  # its backward reduces
    replicated = [Replicate()] * x.device_mesh.ndim
    if tuple(x.placements) != tuple(replicated):
        x = x.redistribute(x.device_mesh, replicated)
    grad = [Partial()] * x.device_mesh.ndim if partial_grad and x.is_floating_point() else replicated
    return x.to_local(grad_placements=grad)


@contextmanager
def _as_local(tensors: list[tuple[dict, str]], grad: list | None = None) -> Iterator[None]:
    """Each DTensor ``table[name]`` replaced by its local tensor for the duration (restored even on
    error); ``grad``: the placements its gradient comes back as (default: the DTensor's own)."""
    saved = [(table, name, table[name]) for table, name in tensors]
    try:
        for table, name, t in saved:
            table[name] = to_local(t, grad)
        yield
    finally:
        for table, name, t in saved:
            table[name] = t

