"""``DistributedOptimizer``: the Megatron-style sharded optimizer (ZeRO-1 state sharding; ZeRO-2
with a wrapper that keeps only grad shards) over the buckets of a data-parallel wrapper.

How a step goes, on every data-parallel rank ``r``::

    finish_grad_sync(models)          # DDP reduce-scatters: bucket range r holds the averaged grad
    master.grad = reduced_grad()      # range r of grad_data; fp32 (a view if it is fp32, else one cast copy)
    unscale / clip                    # global norm: one all-reduce of owned squares
    inner.step()                      # torch optimizer (fused where torch has it) on the flat masters
    param_data[range r] = master      # cast to the model dtype (no copy if the model is fp32)
    all_gather_into_tensor(param_data, param_data[range r])   # per bucket; async with overlap

One flat master per param group and bucket range (``_Flat``: a run of consecutive parameter
pieces; only elementwise optimizers are accepted, so stepping the run equals stepping each piece),
so the inner step, the norm and the copies are one call per group, not one per parameter;
``state_dict()`` still cuts the flat state into per-FQN pieces (``_Shard``).

What is sharded (ZeRO level): optimizer state (``exp_avg``, ``exp_avg_sq``, momentum...) and fp32
master weights are 1/DP per rank: ZeRO-1. Gradients are reduce-scattered and the inner optimizer
reads only this rank's range; whether the rest of the grads stay is the wrapper's layout, read from
its buckets: ``DDP(..., zero_stage=1)`` (``use_distributed_optimizer=True``) keeps a full-size
``grad_data`` per rank (backward accumulates into it), ``DDP(..., zero_stage=2)`` keeps only this
rank's range (ZeRO-2). Nothing here differs between the two, state dicts included. Full-size per
rank either way: ``param_data`` (the model parameters themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
import sys
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from ndweave.mesh.agree import raise_on_every_rank
from ndweave.mesh.contracts import (
    MASTER_KEY,
    DataParallelWrapper,
    GradBucket,
    ShardLayout,
    StatePiece,
    finish_grad_sync,
    finish_grad_sync_for_step,
    is_elementwise,
    is_tied_replica,
    merge_state_dicts,
    resolve_state_value,
    union_state_dicts,
    uses_distributed_optimizer,
)
from ndweave.optim.base import WrappedOptimizer
from ndweave.optim.dcp_state import GuardedPiece, dcp_state_dict, pieces_of_dtensors, refuse_torch_state_dict_api
from ndweave.optim.grad_norm import counts_replica, whole_on_every_rank
from ndweave.optim.inner import check_elementwise, resolve_optimizer
from ndweave.optim.param_gather import ParamGatherer
from ndweave.optim.state_check import LOAD_FIX, StateDictMismatchError, state_dict_mismatches

__all__ = ["DistributedOptimizer"]


@dataclass(eq=False)
class _Flat:
    """This rank's master weights for a run of consecutive parameter pieces of one param group in
    its range of one bucket (usually the whole range): one tensor the inner optimizer steps."""

    bucket: GradBucket
    group: int
    bucket_start: int
    """Range of the run within the bucket's flat buffers."""
    bucket_end: int
    master: torch.nn.Parameter
    """1-D master weights (at least fp32 unless ``grad_to_fp32=False``); its ``.grad`` is the run of
    the bucket's ``reduced_grad()`` (a view when the dtypes agree, else one cast)."""
    aliases_model: bool
    """``master`` is a view of ``param_data`` (same dtype): stepping it updates the model directly."""
    owned: list[tuple[int, int]]
    """Ranges of ``master`` counted in the global grad norm (every piece but replicas, see ``grad_norm``)."""

    def model_range(self) -> torch.Tensor:
        return self.bucket.param_data[self.bucket_start : self.bucket_end]

    def grad_range(self) -> torch.Tensor:
        offset = self.bucket.shard_range()[0]  # reduced_grad() starts at this rank's range
        return self.bucket.reduced_grad()[self.bucket_start - offset : self.bucket_end - offset]


@dataclass(eq=False)
class _Shard:
    """One parameter's part of this rank's range of one bucket: a slice of a ``_Flat``."""

    flat: _Flat
    name: str
    bucket_start: int
    """Range of the piece within the bucket's flat buffers."""
    bucket_end: int
    start: int
    """Range of the piece within the param's flattened local tensor."""
    end: int
    layout: ShardLayout
    """Where the param's local tensor lies in the global one (TP shard, strided or not)."""

    def of(self, flat_value: torch.Tensor) -> torch.Tensor:
        """This piece of a tensor shaped like the flat master (the master, a state tensor)."""
        offset = self.flat.bucket_start
        return flat_value.detach()[self.bucket_start - offset : self.bucket_end - offset]

    @property
    def master(self) -> torch.Tensor:
        return self.of(self.flat.master)

    def piece(self, data: torch.Tensor) -> StatePiece:
        return GuardedPiece(self.name, data, self.layout, self.start, self.end)


class DistributedOptimizer(WrappedOptimizer):
    """Shard optimizer state and fp32 master weights over the data-parallel ranks of ``models``.

    Args:
        optimizer: a torch optimizer class (built with ``optimizer_kwargs``) or an instance built over
            the models' params (re-created over the shards, keeping each group's hyperparameters). It
            must be elementwise (:data:`~ndweave.optim.ELEMENTWISE_OPTIMIZERS`, or
            ``assume_elementwise=True``).
        models: data-parallel wrapped models implementing
            :class:`~ndweave.mesh.contracts.DataParallelWrapper`, laid out for a sharded optimizer
            (their buckets carry ``param_data``: ``DDP(..., use_distributed_optimizer=True)``, ZeRO-1, or
            ``DDP(..., zero_stage=2)``, which keeps only this rank's range of the grads: ZeRO-2).
        clip_grad: clip to this global grad norm in every ``step()`` (0: no clipping).
        overlap_param_gather: issue the parameter all-gathers async after ``step()`` and wait for
            each bucket in a forward pre-hook of the first module that owns one of its params.
        grad_to_fp32: fp32 master weights and fp32 grads for the inner step (default; float64 for a
            float64 model, and no copy at all for an fp32 one). ``False`` steps the model-dtype
            ``param_data`` range directly with model-dtype grads (no master copy; lower precision for
            bf16/fp16 models).
        loss_scaler: fp16 loss scaling (see :mod:`ndweave.optim.loss_scale`).
        grad_norm_group: group the grad norm is summed over (default: the whole world).
        on_nonfinite: ``"raise"`` (default), ``"skip"`` or ``"unchecked"``: what ``step()`` does on an
            inf/nan global grad norm, on every rank alike (:data:`ndweave.optim.base.ON_NONFINITE`).
        grad_scaler: veScale's (Megatron's) name for ``loss_scaler``; pass one or the other.
        fp16, bf16, params_dtype: veScale's dtype flags. The dtypes come from the params here, so
            these only check: a flag the models' params contradict raises.

    Example::

        model = DistributedDataParallel(model, mesh["DP"], use_distributed_optimizer=True)
        opt = DistributedOptimizer(torch.optim.AdamW, [model], optimizer_kwargs={"lr": 1e-3}, clip_grad=1.0)
        for batch in data:
            opt.zero_grad()
            model(batch).sum().backward()
            opt.step()
    """

    def __init__(
        self,
        optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer,
        models: Sequence[torch.nn.Module] | torch.nn.Module,
        *,
        clip_grad: float = 0.0,
        overlap_param_gather: bool = False,
        grad_to_fp32: bool = True,
        optimizer_kwargs: dict[str, Any] | None = None,
        assume_elementwise: bool = False,
        loss_scaler: Any = None,
        grad_norm_group: dist.ProcessGroup | None = None,
        on_nonfinite: Literal["raise", "skip", "unchecked"] = "raise",
        grad_scaler: Any = None,
        fp16: bool | None = None,
        bf16: bool | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        models = [models] if isinstance(models, torch.nn.Module) else list(models)
        self.buckets = self._collect_buckets(models)
        self._model_of_bucket = [index for index, model in enumerate(models) for _ in model.grad_buckets()]
        self._step_waiters: list | None = None  # how this step's parameter gathers are waited for (_sync_grads)
        if grad_scaler is not None:
            if loss_scaler is not None:
                raise ValueError("pass loss_scaler or grad_scaler (veScale's name for it), not both")
            loss_scaler = grad_scaler
        _check_dtype_flags({b.param_data.dtype for b in self.buckets}, fp16=fp16, bf16=bf16, params_dtype=params_dtype)
        spec = resolve_optimizer(optimizer, optimizer_kwargs)
        check_elementwise(spec.cls, assume_elementwise)
        self.grad_to_fp32 = grad_to_fp32
        dtypes, devices = {self._master_dtype(b) for b in self.buckets}, {b.param_data.device for b in self.buckets}
        # torch's fused kernel where it has one, in the groups that left the choice to torch
        self._fused_groups = spec.fused(*dtypes, *devices) if len(dtypes) == len(devices) == 1 else []
        self._group_fqns: list[list[str]] = [[] for _ in spec.groups]
        self._global_shapes: dict[str, tuple[int, ...]] = {}  # of every FQN in a group: what a load checks
        self._flats, self._shards = self._build_flats(spec)
        groups = [[f.master for f in self._flats if f.group == g] for g in range(len(spec.groups))]
        if not any(groups):  # a rank owning only padding still needs a valid torch optimizer
            groups[0].append(torch.nn.Parameter(torch.zeros(0, device=self.buckets[0].grad_data.device)))
        inner = spec.build(groups)
        # Whether a backward ran since the last zero_grad(): without one torch's optimizers leave every
        # param untouched (all grads None), but the buckets' zeroed grad ranges would still be stepped
        # (weight decay, momentum). A one-element list, so the hooks hold no reference to the optimizer.
        self._grads_seen = [any(bp.param.grad is not None for b in self.buckets for bp in b.params)]
        for bucket in self.buckets:
            for bp in bucket.params:
                bp.param.register_post_accumulate_grad_hook(_mark_seen(self._grads_seen))
        self._init_wrapper(inner, models, clip_grad=clip_grad, loss_scaler=loss_scaler, grad_norm_group=grad_norm_group,
                           on_nonfinite=on_nonfinite)
        self._whole = _whole_grad_runs(self.buckets, spec, grad_norm_group)
        self._gatherer = ParamGatherer(self.buckets, models, overlap=overlap_param_gather)

    @staticmethod
    def _collect_buckets(models: list[torch.nn.Module]) -> list[GradBucket]:
        buckets: list[GradBucket] = []
        for model in models:
            if not isinstance(model, DataParallelWrapper):
                raise TypeError(
                    f"DistributedOptimizer needs data-parallel wrapped models (a DataParallelWrapper such as "
                    f"ndweave.ddp.DistributedDataParallel(..., use_distributed_optimizer=True)); got "
                    f"{type(model).__name__}. For an unwrapped model use BasicOptimizer"
                )
            if model.grad_buckets() and not uses_distributed_optimizer(model):
                raise ValueError(
                    f"{type(model).__name__} was built with use_distributed_optimizer=False: it all-reduces grads and "
                    "its buckets have no param_data. Build it with use_distributed_optimizer=True for "
                    "DistributedOptimizer, or use BasicOptimizer"
                )
            buckets.extend(model.grad_buckets())
        if not buckets:
            raise ValueError("the models have no grad buckets (no trainable parameters?)")
        return buckets

    def _master_dtype(self, bucket: GradBucket) -> torch.dtype:
        # "fp32" masters means at least fp32: a float64 model keeps float64 masters
        dtype = bucket.param_data.dtype
        return torch.promote_types(dtype, torch.float32) if self.grad_to_fp32 else dtype

    def _build_flats(self, spec) -> tuple[list[_Flat], list[_Shard]]:
        """One ``_Flat`` per run of consecutive pieces of one group in this rank's range of a bucket."""
        flats: list[_Flat] = []
        shards: list[_Shard] = []
        names: dict[str, int] = {}
        for bucket in self.buckets:
            dp_ranks = None if bucket.data_parallel_group is None else tuple(
                dist.get_process_group_ranks(bucket.data_parallel_group))
            lo, hi = bucket.shard_range()
            runs: list[tuple[int, list]] = []  # (group, [(bp, start, end)]): pieces in buffer order
            for bp in bucket.params:
                if names.setdefault(bp.name, id(bp.param)) != id(bp.param):
                    raise ValueError(f"two parameters are named {bp.name!r}; FQNs must be unique across models")
                index = spec.group_index(bp.param)
                if index is None:  # not in the user's optimizer: never updated, still gathered
                    continue
                self._group_fqns[index].append(bp.name)
                self._global_shapes[bp.name] = tuple(bp.param.shape)
                start, end = max(lo, bp.offset), min(hi, bp.offset + bp.numel)
                if start >= end:
                    continue
                if not runs or runs[-1][0] != index or runs[-1][1][-1][2] != start:
                    runs.append((index, []))
                runs[-1][1].append((bp, start, end))
            for index, pieces in runs:
                flat = self._make_flat(bucket, index, pieces[0][1], pieces[-1][2])
                for bp, start, end in pieces:
                    shards.append(_Shard(flat=flat, name=bp.name, bucket_start=start, bucket_end=end,
                                         start=start - bp.offset, end=end - bp.offset, layout=ShardLayout.of(bp.param)))
                    if counts_replica(bp.param, dp_ranks) and not is_tied_replica(bp.param):
                        a, b = start - flat.bucket_start, end - flat.bucket_start
                        if flat.owned and flat.owned[-1][1] == a:
                            a = flat.owned.pop()[0]
                        flat.owned.append((a, b))
                flats.append(flat)
        return flats, shards

    def _make_flat(self, bucket: GradBucket, group: int, start: int, end: int) -> _Flat:
        view = bucket.param_data[start:end]
        master_dtype = self._master_dtype(bucket)
        aliases = view.dtype == master_dtype
        master = torch.nn.Parameter(view if aliases else view.detach().to(master_dtype))
        return _Flat(bucket=bucket, group=group, bucket_start=start, bucket_end=end, master=master,
                     aliases_model=aliases, owned=[])

    # ---- the step ----------------------------------------------------------------------------
    def _sync_grads(self) -> None:
        self._gatherer.wait()
        if self._gatherer.apart and self.loss_scaler is None and self._whole is not None and self._grads_seen[0]:
            # the step's only collectives are the gathers, on groups of their own: the wrappers' check
            # before the step rides them (a gather of its own costs a tenth of a small step on gloo)
            waiters = finish_grad_sync_for_step(self.models)
            self._step_waiters = [waiters[index] for index in self._model_of_bucket]
        else:
            finish_grad_sync(self.models)
            self._step_waiters = None
        for flat in self._flats:
            if not self._grads_seen[0]:  # no backward since zero_grad(): no grads, as in torch
                flat.master.grad = None
                continue
            grad = flat.grad_range()
            flat.master.grad = grad if grad.dtype == flat.master.dtype else grad.to(flat.master.dtype)

    def _whole_grads(self) -> list[torch.Tensor] | None:
        return self._whole if self._grads_seen[0] else None

    def _owned_grads(self) -> list[torch.Tensor]:
        return [f.master.grad[a:b] for f in self._flats if f.master.grad is not None for a, b in f.owned]

    def _local_grads(self) -> list[torch.Tensor]:
        return [f.master.grad for f in self._flats if f.master.grad is not None]

    def _apply_step(self) -> None:
        self.inner.step()
        self._publish(self._step_waiters)

    def _publish(self, waiters: list | None = None) -> None:
        """Write the masters into the model's ranges and all-gather every bucket (``waiters``: the
        step's, from ``finish_grad_sync_for_step``)."""
        with torch.no_grad():
            for flat in self._flats:
                if not flat.aliases_model:
                    flat.model_range().copy_(flat.master)
        self._gatherer.gather(waiters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the models' grad buffers (``zero_grad_buffer()``) and the masters' grads: dropped, or
        with ``set_to_none=False`` zeroed in place (torch's meaning)."""
        for model in self.models:
            model.zero_grad_buffer()
        if set_to_none:
            self._grads_seen[0] = False
        for flat in self._flats:
            if set_to_none:
                flat.master.grad = None
            elif flat.master.grad is not None:
                flat.master.grad.zero_()
        self._grads_ready = False

    def get_parameters(self) -> list[torch.Tensor]:
        """This rank's master weights, one 1-D view per parameter piece (of the flat masters in
        ``param_groups``, which the inner optimizer steps); a zero-size placeholder on a rank that
        owns only padding."""
        return [shard.master for shard in self._shards] or super().get_parameters()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "DistributedOptimizer shards the params of its models' grad buckets, fixed at construction: pass an "
            "optimizer instance with all its param groups instead"
        )

    # ---- overlap ------------------------------------------------------------------------------
    def wait_param_gather(self) -> None:
        """Wait for every pending parameter all-gather (needed only to read params outside forward)."""
        self._gatherer.wait()

    def pending_param_gathers(self) -> list[int]:
        """Indices of buckets whose all-gather is in flight (with ``overlap_param_gather``)."""
        return self._gatherer.pending()

    @property
    def param_gather_waits(self) -> list[int]:
        """Per bucket, how many pending gathers were waited on."""
        return list(self._gatherer.num_waits)

    # ---- memory -------------------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        """Bytes of the inner optimizer's state tensors on this rank (not counting master weights)."""
        return sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))

    def master_param_bytes(self) -> int:
        """Bytes of fp32 master weights held apart from the model (0 when they alias an fp32 model)."""
        return sum(f.master.numel() * f.master.element_size() for f in self._flats if not f.aliases_model)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def state(self):  # type: ignore[override]
        # torch's get/set_state_dict read ``optim.state`` first; refused there with the calls that work
        refuse_torch_state_dict_api(sys._getframe(1).f_globals)
        return self.inner.state

    @state.setter
    def state(self, value) -> None:
        self.inner.state = value

    def _state_dict(self, format: Literal["pieces", "dcp"] = "pieces") -> dict[str, Any]:
        """``state_dict()``: this rank's state keyed by parameter FQN, ``{"param_groups": [{...,
        "params": [fqn, ...]}], "state": {fqn: {key: value}}}``.

        ``format="pieces"`` (default): this rank's ranges as StatePieces (the format of
        :mod:`ndweave.mesh.contracts.optimizer_state`; views of the live state), for
        ``ndweave.checkpoint``, ``merge_state_dicts`` and loads at any layout. torch's DCP refuses them
        (it cannot describe a flat range), on every rank, naming the calls that work.

        ``format="dcp"``: the form torch's ``get_state_dict`` gives for a torch optimizer of the model,
        which ``dcp.save`` / ``dcp.load`` handle natively at any layout: every parameter of the groups,
        each elementwise state tensor shaped and placed like the parameter (a DTensor where it is one),
        the master weights too where they are not the model's parameters (bf16 models). A collective
        over the data-parallel ranks (the values are all-gathered: each rank briefly holds its
        tensor-parallel share of the whole state). A never-stepped optimizer gives zeros, the
        destination ``dcp.load`` reads into::

            dcp.save({"model": model.state_dict(), "optim": opt.state_dict(format="dcp")}, checkpoint_id=path)
            state = {"model": model.state_dict(), "optim": opt.state_dict(format="dcp")}   # any layout
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
        """
        if format not in ("pieces", "dcp"):
            raise ValueError(f"state_dict(format={format!r}): format is 'pieces' (this rank's ranges, the default) "
                             "or 'dcp' (per-parameter tensors for torch.distributed.checkpoint)")
        self._gatherer.wait()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(fqns)}
                  for g, fqns in zip(self.inner.param_groups, self._group_fqns)]
        for index in self._fused_groups:  # the fused kernel was our choice, not a hyperparameter: saved as left
            groups[index]["fused"] = None
        if format == "dcp":
            state = dcp_state_dict(self.buckets, self._shards, self.inner, self._group_fqns,
                                   [self._master_dtype(b) for b in self.buckets])
        else:
            state = self._piece_state()
        return {"param_groups": groups, "state": state}

    def _piece_state(self) -> dict[str, dict[str, Any]]:
        state: dict[str, dict[str, Any]] = {}
        for shard in self._shards:
            entry = {MASTER_KEY: shard.piece(shard.master)}
            for key, value in self.inner.state.get(shard.flat.master, {}).items():
                if is_elementwise(key, value, shard.flat.master.shape):
                    entry[key] = shard.piece(shard.of(value))
                else:  # one per flat: a copy per FQN, which a torch optimizer loading them must not share
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            state[shard.name] = entry
        return state

    def gather_full_state_dict(self, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """The full per-FQN state (global shapes) on every rank of ``group`` (a collective; holds the
        whole state in CPU memory: for tests, conversion and small models)."""
        local = self._state_dict()
        local["state"] = {fqn: {k: _to_cpu(v) for k, v in e.items()} for fqn, e in local["state"].items()}
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, local, group=group)
        return merge_state_dicts(everyone)

    def _load_state_dict(self, state_dict: dict[str, Any] | Sequence[dict[str, Any]], strict: bool = True) -> None:
        """``load_state_dict()``: load this rank's own ``state_dict()``, the sharded state dicts of
        *every* rank of a run with any other layout (a list: e.g. written at DP=4 x TP=1, loaded at
        DP=2 x TP=2), or a full state.

        First every rank checks the state against this optimizer (number of param groups, an entry
        for every param it holds a shard of, global shapes; ``strict=False`` lets params without an
        entry keep their state) and the ranks agree, so a mismatch raises
        :class:`~ndweave.optim.StateDictMismatchError` on every rank (one ``all_gather_object`` over
        ``grad_norm_group``). Then sets master weights, state and group hyperparameters, writes the
        masters into the model and all-gathers (a collective)."""
        if isinstance(state_dict, (list, tuple)) and state_dict:
            state_dict = union_state_dicts(state_dict)
        state_dict = pieces_of_dtensors(state_dict)  # state_dict(format="dcp"), a torch optimizer's of a TP model
        needed = list(dict.fromkeys(shard.name for shard in self._shards))
        problems = state_dict_mismatches(state_dict, len(self.inner.param_groups), self._global_shapes, needed,
                                         strict=strict)
        raise_on_every_rank(self.grad_norm_group, f"{type(self).__name__}.load_state_dict", problems,
                            StateDictMismatchError, LOAD_FIX)
        self._gatherer.wait()
        groups = state_dict["param_groups"]
        for index, (mine, theirs) in enumerate(zip(self.inner.param_groups, groups)):
            kept = ("params", "fused") if index in self._fused_groups else ("params",)
            mine.update({k: v for k, v in theirs.items() if k not in kept})
        with torch.no_grad():
            for shard in self._shards:
                entry = state_dict["state"].get(shard.name)
                if entry is None:
                    continue
                for key, value in entry.items():
                    value, elementwise = resolve_state_value(value, key, shard.name, shard.layout, shard.start,
                                                             shard.end)
                    if key == MASTER_KEY:
                        shard.master.copy_(value.reshape(-1))
                        continue
                    state = self._flat_state(shard.flat)
                    if elementwise:
                        if key not in state:
                            state[key] = torch.zeros_like(shard.flat.master.detach())
                        shard.of(state[key]).copy_(value.reshape(-1))
                    elif isinstance(value, torch.Tensor):  # one per flat (its pieces step together)
                        like = state.get(key, value)  # the device and dtype the step takes (fused: fp32)
                        state[key] = value.to(like.device, like.dtype, copy=True)
                    else:
                        state[key] = value
        was_overlapped, self._gatherer.overlap = self._gatherer.overlap, False
        try:
            self._publish()
        finally:
            self._gatherer.overlap = was_overlapped

    def _flat_state(self, flat: _Flat) -> dict[str, Any]:
        """``flat``'s state in the inner optimizer; where there is none yet, the state a first step
        starts from (elementwise values from a probe step with zero grads, see ``InnerSpec.probe_state``),
        so the pieces a load leaves out keep the optimizer's own initial values."""
        state = self.inner.state.setdefault(flat.master, {})
        if not state:
            probe = resolve_optimizer(self.inner, None).probe_state(flat.group, flat.master.dtype, flat.master.device)
            for key, value in probe.items():
                elementwise = is_elementwise(key, value, (2,))
                state[key] = value[:1].expand(flat.master.numel()).clone() if elementwise else value
        return state


def _whole_grad_runs(buckets: Sequence[GradBucket], spec, norm_group: dist.ProcessGroup | None) -> list[torch.Tensor] | None:
    """The runs of ``grad_data`` holding the grads of the optimizer's params, where the norm may read
    them whole with no collective (``whole_on_every_rank``); ``None`` otherwise."""
    if not whole_on_every_rank(buckets, norm_group):
        return None
    runs: list[torch.Tensor] = []
    for bucket in buckets:
        start = end = None  # a run of stepped params with nothing else between (a slot's padding is zero)
        for bp in [*bucket.params, None]:
            if bp is not None and is_tied_replica(bp.param):
                return None
            if bp is not None and spec.group_index(bp.param) is not None:
                start = bp.offset if start is None else start
                end = bp.offset + bp.numel
            elif start is not None:
                runs.append(bucket.grad_data[start:end])
                start = None
    return runs


def _check_dtype_flags(dtypes: set[torch.dtype], **flags: Any) -> None:
    """veScale's ``fp16=``/``bf16=``/``params_dtype=`` against the dtypes the params actually have."""
    wanted = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for flag, value in flags.items():
        dtype = value if flag == "params_dtype" else wanted[flag] if value else None
        if dtype is not None and dtype not in dtypes:
            raise ValueError(
                f"DistributedOptimizer({flag}={value}) but the models' params are {sorted(map(str, dtypes))}: the "
                f"dtype comes from the params here; convert the model (model.to({dtype})) before wrapping, or drop {flag}="
            )


def _mark_seen(seen: list[bool]):
    def hook(param: torch.Tensor) -> None:
        seen[0] = True

    return hook


def _to_cpu(value: Any) -> Any:
    if isinstance(value, StatePiece):
        return replace(value, data=value.data.detach().cpu().clone())
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
