"""A ``DistributedOptimizer``'s state and torch's distributed checkpoint (DCP): what DCP refuses, and
``state_dict(format="dcp")``, which DCP saves and reshards by itself.

DCP plans tensors: DTensors and ShardedTensors chunk by chunk, plain tensors as one copy, and any
tensor that lists its own chunks through DCP's checkpointable hooks. Any other value it pickles, one
value per key, written by one rank. ``state_dict()`` holds :class:`~ndweave.mesh.contracts.StatePiece`s
(this rank's flat range of each parameter, cutting rows anywhere), which are not tensors: a plain
``dcp.save({"optim": optimizer.state_dict()})`` kept one rank's pieces of each key and the load
failed afterwards ("the pieces of ... leave N of N elements uncovered"). So:

* the pieces ``state_dict()`` returns are :class:`GuardedPiece`\\ s: ``StatePiece``\\ s to every
  reader (and pickled as plain ones) that answer DCP's save planner by refusing, naming the key and
  the calls that work. DCP collects planning errors from every rank, so such a save fails on every
  rank before anything is written. (A load into them fails while DCP plans too, with DCP's own
  message: its load planner drops values it does not know before asking them anything.);
* torch's ``get_state_dict`` / ``set_state_dict`` (and ``get_/set_optimizer_state_dict``) map an
  optimizer's params to the model's by identity, and the 1-D master shards a ``DistributedOptimizer``
  steps are none of them: torch failed with a bare ``KeyError`` (a parameter FQN). Their first touch
  of the optimizer (``optim.state``, from torch's state-dict module) is refused by
  :func:`refuse_torch_state_dict_api` instead, on every rank (each calls it), before anything is
  read, stepped or written, naming the calls that work;
* :func:`dcp_state_dict` is the state as torch's ``get_state_dict`` gives it for a torch optimizer of
  the same model: keyed by FQN, one tensor per parameter and state key, shaped and placed like the
  parameter (a DTensor over the parameter's mesh), its values all-gathered over the data-parallel
  ranks. DCP saves, deduplicates and reshards that natively; a torch optimizer's checkpoint of the
  same model reads into it, and it reads into a torch optimizer's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.mesh.collectives import all_gather_flat
from ndweave.mesh.contracts import MASTER_KEY, GradBucket, ShardLayout, StatePiece, is_elementwise
from ndweave.mesh.torch_compat import StridedShard, dtensor_over, local_tensor
from ndweave.optim.inner import resolve_optimizer

__all__ = ["GuardedPiece", "dcp_state_dict", "pieces_of_dtensors", "refuse_torch_state_dict_api"]

#: torch's module of ``get_state_dict`` / ``set_state_dict`` (public, so its name is stable): a read
#: of ``DistributedOptimizer.state`` from code in it is refused (:func:`refuse_torch_state_dict_api`).
TORCH_STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"


def _refusal(what: str) -> str:
    return (f"{what}: DistributedOptimizer.state_dict() holds this rank's flat ranges of the parameters "
            "(StatePieces), which DCP's planners cannot describe, so DCP would keep one rank's ranges. With "
            "torch's DCP use optimizer.state_dict(format='dcp') instead (per-parameter DTensors, as torch's "
            "get_state_dict gives for a torch optimizer; it also serves as the destination of dcp.load, after "
            "which optimizer.load_state_dict takes it), or save and load with ndweave.checkpoint.save / load, "
            "which write the ranges themselves without gathering them")


def refuse_torch_state_dict_api(caller_globals: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` when the code reading ``DistributedOptimizer.state`` (its module globals:
    ``caller_globals``) is torch's ``get_state_dict`` / ``set_state_dict`` family, naming what works."""
    if caller_globals.get("__name__") != TORCH_STATE_DICT_MODULE:
        return
    raise TypeError(
        "torch's get_state_dict / set_state_dict (and get_/set_optimizer_state_dict) cannot serve a "
        "DistributedOptimizer: they map an optimizer's params to the model's by identity, and it steps 1-D "
        "shards of fp32 master weights, none of them the model's. For the optimizer use "
        "optimizer.state_dict(format='dcp') (per-parameter DTensors, what get_state_dict gives for a torch "
        "optimizer; dcp.save / dcp.load handle it at any layout) and optimizer.load_state_dict(state); for the "
        "model get_model_state_dict / set_model_state_dict work as they are. Or save and load both with "
        "ndweave.checkpoint.save / load")


class GuardedPiece(StatePiece):
    """A :class:`~ndweave.mesh.contracts.StatePiece` that DCP's planners refuse (module docstring);
    everything else reads it as the ``StatePiece`` it is."""

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        raise TypeError(_refusal(f"dcp.save cannot save {fqn!r}"))

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled as a plain StatePiece: a saved state dict reads back without ndweave.optim
        return (StatePiece, (self.fqn, self.data, self.layout, self.start, self.end))


def _fresh_state(inner: torch.optim.Optimizer, group: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The state entries a step of ``inner``'s optimizer creates for a parameter of param group
    ``group`` (``dtype``, on ``device``), zeroed: tensors of the shape ``(2,)`` are elementwise. Found
    by stepping a throwaway optimizer over a two-element tensor, so every rank finds the same keys
    without communication, whether or not it has stepped."""
    state = resolve_optimizer(inner, None).probe_state(group, dtype, device)
    return {key: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for key, v in state.items()}


def _like_param(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``flat`` (the param's local numel) shaped and placed like ``param``: a DTensor over its mesh."""
    local = flat.view(local_tensor(param).shape)
    if isinstance(param, DTensor):
        return dtensor_over(local, param.device_mesh, param.placements, param.shape, param.stride())
    return local


def _refuse_strided(buckets: Sequence[GradBucket], group_of: Mapping[str, int]) -> None:
    for bucket in buckets:
        for bp in bucket.params:
            if bp.name in group_of and isinstance(bp.param, DTensor) and any(
                    isinstance(p, StridedShard) for p in bp.param.placements):
                raise ValueError(
                    f"state_dict(format='dcp'): {bp.name!r} is laid out {list(bp.param.placements)}, which DCP "
                    "refuses to save (a StridedShard DTensor is not one chunk of the global tensor); save with "
                    "ndweave.checkpoint.save, which stores such tensors as several chunks")


def dcp_state_dict(buckets: Sequence[GradBucket], shards: Sequence[Any], inner: torch.optim.Optimizer,
                   group_fqns: Sequence[Sequence[str]],
                   master_dtypes: Sequence[torch.dtype]) -> dict[str, dict[str, Any]]:
    """``{fqn: {key: value}}`` of every parameter of ``group_fqns``: elementwise state (and the master
    weights where they are not the model's own ``param_data``) as tensors like the parameter, the
    rest (``step``) as the owners hold it. ``shards`` are the optimizer's ``_Shard``\\ s (slices of its
    flat masters, ``_Flat``\\ s),
    ``master_dtypes`` the masters' dtype per bucket. A collective over each bucket's data-parallel
    group: one all-gather per bucket and elementwise key, one ``all_gather_object`` of the scalars.
    A parameter no rank has stepped yet gets zeros (the destination a load reads into)."""
    group_of = {fqn: index for index, fqns in enumerate(group_fqns) for fqn in fqns}
    _refuse_strided(buckets, group_of)
    state: dict[str, dict[str, Any]] = {fqn: {} for fqns in group_fqns for fqn in fqns}
    fresh: dict[tuple[int, torch.dtype], dict[str, Any]] = {}
    for bucket, dtype in zip(buckets, master_dtypes):
        members = [(bp, group_of[bp.name]) for bp in bucket.params if bp.name in group_of]
        for group in {g for _, g in members}:
            if (group, dtype) not in fresh:
                fresh[group, dtype] = _fresh_state(inner, group, dtype, bucket.param_data.device)
        mine = list({id(s.flat): s.flat for s in shards if s.flat.bucket is bucket}.values())
        for key, like in _elementwise_keys(members, fresh, dtype, aliased=bucket.param_data.dtype == dtype):
            flat = _gathered(bucket, mine, inner, key, like)
            for bp, group in members:
                if key == MASTER_KEY or key in fresh[group, dtype]:
                    state[bp.name][key] = _like_param(flat[bp.offset : bp.offset + bp.numel], bp.param)
        for bp, group in members:
            for key, value in fresh[group, dtype].items():
                if not is_elementwise(key, value, (2,)):
                    state[bp.name][key] = value
    _gather_scalars(buckets, shards, inner, state)
    return state


def _elementwise_keys(members: Sequence[tuple[Any, int]], fresh: Mapping[tuple[int, torch.dtype], dict[str, Any]],
                      dtype: torch.dtype, aliased: bool) -> list[tuple[str, torch.Tensor]]:
    """``(key, zero template)`` of the bucket's elementwise state, masters first unless they are the
    model's own ``param_data`` (its state dict holds them then)."""
    keys: dict[str, torch.Tensor] = {} if aliased else {MASTER_KEY: torch.zeros(2, dtype=dtype)}
    for group in dict.fromkeys(g for _, g in members):
        for key, value in fresh[group, dtype].items():
            if is_elementwise(key, value, (2,)):
                keys.setdefault(key, value)
    return list(keys.items())


@torch.no_grad()
def _gathered(bucket: GradBucket, mine: Sequence[Any], inner: torch.optim.Optimizer, key: str,
              like: torch.Tensor) -> torch.Tensor:
    """A flat buffer like the bucket's holding state ``key`` of every rank's ranges (``mine``: this
    rank's flat masters; zeros where no state exists yet), all-gathered in place like ``param_data``."""
    flat = torch.zeros(bucket.param_data.numel(), dtype=like.dtype, device=bucket.param_data.device)
    for run in mine:
        value = run.master if key == MASTER_KEY else inner.state.get(run.master, {}).get(key)
        if isinstance(value, torch.Tensor):
            flat[run.bucket_start : run.bucket_end].copy_(value.reshape(-1))
    if bucket.data_parallel_size > 1:
        start, end = bucket.shard_range()
        all_gather_flat(flat, flat[start:end], group=bucket.data_parallel_group)
    return flat


def _gather_scalars(buckets: Sequence[GradBucket], shards: Sequence[Any], inner: torch.optim.Optimizer,
                    state: dict[str, dict[str, Any]]) -> None:
    """Replace the zero scalars (``step``) of ``state`` by the values the owners of each parameter hold
    (all alike): the ranks of a data-parallel group exchange theirs (one ``all_gather_object`` per
    group), since a rank holding no range of a parameter has none."""
    owned: dict[str, dict[str, Any]] = {}
    for shard in shards:
        for key, value in inner.state.get(shard.flat.master, {}).items():
            if key in state[shard.name] and not is_elementwise(key, value, shard.flat.master.shape):
                owned.setdefault(shard.name, {})[key] = value.cpu() if isinstance(value, torch.Tensor) else value
    everyone = [owned]
    groups = {id(b.data_parallel_group): b.data_parallel_group for b in buckets if b.data_parallel_size > 1}
    for group in groups.values():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, owned, group=group)
        everyone += gathered
    for scalars in everyone:
        for fqn, entry in scalars.items():
            for key, value in entry.items():
                template = state[fqn][key]
                # a copy each: the pieces of one flat master share one scalar, a torch optimizer must not
                state[fqn][key] = value.to(template.device, copy=True) if isinstance(template, torch.Tensor) else value


def pieces_of_dtensors(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with every DTensor value as the :class:`StatePiece` of this rank's whole local
    tensor (what ``resolve_state_value`` reshards any range from): how ``load_state_dict`` reads
    :func:`dcp_state_dict`'s form, or a torch optimizer's state of a tensor-parallel model."""
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(state, Mapping):
        return state_dict
    converted = {fqn: {key: _piece_of(fqn, value) for key, value in entry.items()} if isinstance(entry, Mapping)
                 else entry for fqn, entry in state.items()}
    return {**state_dict, "state": converted}


def _piece_of(fqn: str, value: Any) -> Any:
    if not isinstance(value, DTensor):
        return value
    return StatePiece(fqn, local_tensor(value).detach().reshape(-1), ShardLayout.of(value))
