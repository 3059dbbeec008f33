"""``DistributedDataParallel``: data parallelism over one mesh dim, for plain and DTensor params."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ndweave.ddp import sync
from ndweave.ddp.buffer import ParamSlot, build_buckets, lay_out_for_compile
from ndweave.ddp.data_dims import resolve_data_mesh
from ndweave.ddp.check_wait import CarriedRows
from ndweave.ddp.desync import ROW_WIDTH, SyncCounters, check_same_wrap
from ndweave.ddp.grad_shard import GradShards
from ndweave.ddp.wrap_checks import (DEFAULT_BUCKET_SIZE, WRAPPED_MARK, check_bucket_size, check_materialized,
                                     check_not_wrapped, check_zero_stage, fingerprint, synced_params)
from ndweave.mesh import ParallelMesh
from ndweave.mesh.contracts import GradBucket, GradReduction, MicroBatchControl, StepWaiter
from ndweave.mesh.torch_compat import (compiled_in_place, dtensor_over, holds_compiled_code, local_tensor,
                                      queue_backward_callback)

__all__ = ["DistributedDataParallel", "DDP", "DEFAULT_BUCKET_SIZE"]

class DistributedDataParallel(MicroBatchControl, torch.nn.Module):
    """Data parallelism over the ``"DP"`` dim of a mesh, composing with tensor/sequence parallelism.

    Gradients are accumulated into contiguous per-dtype buffers cut into buckets; each bucket is
    all-reduced (or reduce-scattered, for a sharded optimizer) over the data-parallel group as soon as
    its last grad is ready, overlapping the rest of backward. DTensor parameters (sharded over other
    mesh dims) are synced through their local shards, and grads that come out ``Partial`` on a
    non-DP dim are reduced on that dim once per step. After the sync, every parameter's ``.grad``
    holds the reduced gradient, so any torch optimizer can step. It implements
    :class:`ndweave.mesh.contracts.DataParallelWrapper` (micro-batch control, grad buckets)::

        model = DDP(model, DEVICE_MESH["DP"])
        loss = model(x).sum(); loss.backward()   # grads reduced when backward returns
        optimizer.step(); optimizer.zero_grad()
        model.close()                            # hooks removed, grad buffers released (end of training)

    Expert parallel: given a mesh with an ``"EP"`` dim (``DDP(model, mesh)``, mesh ``("DP", "EP")``
    or ``("DP", "EP", "TP")``), EP splits the batch too, so dense grads are reduced over DP x EP and
    experts (sharded over EP) over DP, all averaged over DP x EP (``data_dims.py``).

    Args:
        module: the model (plain, or with DTensor parameters on meshes that may include the DP dim).
        data_mesh_or_group: a 1-D ``DeviceMesh`` (``DEVICE_MESH["DP"]``), a ``ParallelMesh`` or
            multi-dim ``DeviceMesh`` (its ``dim`` dim is used, and its ``"EP"`` dim if it has one), a
            ``ProcessGroup``, or ``None`` for the default ``DEVICE_MESH``'s ``dim`` (and ``"EP"``) dim.
        dim: name of the data-parallel mesh dim (default ``"DP"``).
        bucket_size: elements per bucket (a bucket closes once it holds at least this many);
            ``None`` for one bucket per dtype.
        overlap_grad_reduce: launch each bucket's collective from backward as soon as it is ready;
            ``False`` launches them all in :meth:`finish_grad_sync`.
        use_distributed_optimizer: reduce-scatter instead of all-reduce, so DP rank ``r`` holds the
            reduced range ``bucket.shard_range(r)`` of each bucket, and lay the parameters out in
            flat ``param_data`` buffers (see :meth:`grad_buckets`): ``zero_stage=1``. (On gloo the
            buckets are all-reduced in place all the same: cheaper there, see ``sync.reduces_by_all_reduce``.)
        zero_stage: how much of the training state a sharded optimizer's DP ranks split (DeepSpeed's
            stages; default: 1 with ``use_distributed_optimizer=True``, else 0). ``0``: all-reduce,
            every rank holds every grad. ``1``: as ``use_distributed_optimizer=True`` (optimizer state
            sharded by the optimizer; a full-size grad buffer per rank). ``2``: grads sharded too: each
            rank keeps only its range of every bucket's grads (``grad_data``, 1/DP) plus the full-size
            buckets a backward is filling or reducing, at the cost of a reduce-scatter per micro-batch
            (``grad_shard.py``); no ``.grad`` is set. ``3`` (params too) is FSDP's: refused, naming it.
        accumulate_allreduce_grads_in_fp32: keep (accumulate and reduce) grads of low-precision
            params in fp32. The fp32 grad is ``param.main_grad``; ``.grad`` is a cast copy of it.
        average_grads: divide the summed grads by the DP size (the mean over the global batch when
            each rank's loss is a mean over its micro-batch); ``False`` sums.
        average_in_collective: average with ``ReduceOp.AVG`` (NCCL) rather than by scaling grads by
            ``1/dp_size`` as they are accumulated.
        params_to_ignore: names (FQNs) or parameters not to sync: their grads stay as computed and
            they are not broadcast. Params with ``requires_grad=False`` are never synced.
        broadcast_params: copy params and buffers from DP rank 0 at wrap time, so every replica
            starts equal whatever its seed.
        finish_grad_sync_in_backward: call :meth:`finish_grad_sync` at the end of the backward of the
            last micro-batch (like torch's DDP), so ``.grad`` is ready when ``backward()`` returns.
        detect_desync: before each grad sync's grads are used and before each ``step()``, compare the
            DP ranks' counts (carried by the last bucket's all-reduce and the optimizer's parameter
            gathers on gloo, see :meth:`finish_grad_sync_for_step`; else one small ``all_gather`` on a
            gloo group of the DP ranks), so a rank that skipped a
            ``backward()`` or a ``step()``, stepped once more or entered ``no_sync()`` alone raises
            :class:`~ndweave.ddp.GradSyncDivergedError` on every rank, naming it, within
            ``desync_timeout`` instead of a hang, a gloo abort or a silently wrong average (see
            ``desync.py``). ``False``: no check.
        desync_timeout: seconds a rank waits at that check for peers that do not come (after the first
            step; before it, the DP group's timeout). A job whose ranks do work of their own between
            steps for longer (rank 0 alone writing files) raises it.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        data_mesh_or_group: ParallelMesh | DeviceMesh | dist.ProcessGroup | None = None,
        *,
        dim: str = "DP",
        bucket_size: int | None = DEFAULT_BUCKET_SIZE,
        overlap_grad_reduce: bool = True,
        use_distributed_optimizer: bool | None = None,
        zero_stage: int | None = None,
        accumulate_allreduce_grads_in_fp32: bool = True,
        average_grads: bool = True,
        average_in_collective: bool = False,
        params_to_ignore: Iterable[str | torch.nn.Parameter] = (),
        broadcast_params: bool = True,
        finish_grad_sync_in_backward: bool = True,
        detect_desync: bool = True,
        desync_timeout: float = 60.0,
    ) -> None:
        check_not_wrapped(module, DistributedDataParallel)
        check_bucket_size(bucket_size)
        check_materialized(module)
        super().__init__()
        self.module = module
        data = resolve_data_mesh(data_mesh_or_group, dim)
        self.data_parallel_mesh = data.mesh
        self.data_parallel_size = data.size()
        self.data_parallel_group = data.group()
        self.zero_stage = check_zero_stage(self.data_parallel_group, use_distributed_optimizer, zero_stage)
        self.use_distributed_optimizer = use_distributed_optimizer = self.zero_stage >= 1
        self.overlap_grad_reduce = overlap_grad_reduce
        self.average_grads = average_grads
        self.average_in_collective = average_in_collective and average_grads
        self.finish_grad_sync_in_backward = finish_grad_sync_in_backward
        if self.average_in_collective and self.data_parallel_group is not None:
            if dist.get_backend(self.data_parallel_group) == "gloo":
                raise ValueError("average_in_collective=True needs ReduceOp.AVG, which gloo lacks; leave it False")

        named = list(module.named_parameters())
        params_to_ignore = list(params_to_ignore)
        synced = synced_params(named, params_to_ignore)
        synced_ids = {id(p) for _, p in synced}
        self._ignored = [(n, p) for n, p in named if id(p) not in synced_ids]
        # frozen when wrapped, so never synced: unfreezing one later would train it apart on each rank
        chosen = {x if isinstance(x, str) else id(x) for x in params_to_ignore}
        self._frozen = [(n, p) for n, p in named if not p.requires_grad and not {n, id(p)} & chosen]
        ignored_ids = {id(p) for _, p in self._ignored if p.requires_grad}
        states = [(n, p) for n, p in named if id(p) not in ignored_ids] + list(module.named_buffers())
        # the group each param and buffer is reduced and broadcast over (its checks run before any collective)
        group_of = {id(t): data.group(data.reduction_dims(n, t)) for n, t in states}
        check_same_wrap(self.data_parallel_group, fingerprint(
            module, synced_ids, bucket_size=bucket_size, zero_stage=self.zero_stage,
            accumulate_allreduce_grads_in_fp32=accumulate_allreduce_grads_in_fp32, detect_desync=detect_desync))
        if broadcast_params and self.data_parallel_group is not None:
            by_group: dict[dist.ProcessGroup | None, list[torch.Tensor]] = {}
            for _, t in states:  # an expert from its own DP rank 0: each EP rank holds other experts
                by_group.setdefault(group_of[id(t)], []).append(t)
            for group, tensors in by_group.items():
                if group is not None:
                    sync.broadcast_from_first(tensors, group)

        fp32 = accumulate_allreduce_grads_in_fp32
        compiled = any(holds_compiled_code(m) for m in module.modules())
        # the desync check after backward rides the last bucket's all-reduce where that is a gloo sum
        # (a gather of its own costs as much CPU as a bucket's reduction there; see ``_carry_check``)
        carry = (detect_desync and self.data_parallel_group is not None and self.zero_stage < 2
                 and not self.average_in_collective and dist.get_backend(self.data_parallel_group) == "gloo")
        trailing = CarriedRows.numel(self.data_parallel_size, ROW_WIDTH) if carry else 0
        self._buckets, self._slots, self._grad_buffers = build_buckets(
            synced,
            bucket_size=bucket_size,
            grad_dtype_of=lambda dt: torch.promote_types(dt, torch.float32) if fp32 and dt.is_floating_point else dt,
            group_of=lambda name, p: group_of[id(p)],
            with_param_data=use_distributed_optimizer,
            shard_grads=self.zero_stage == 2,
            # blocks compiled before wrapping (block.compile()): dynamo fakes each param and its grad
            compilable=compiled,
            trailing=trailing,
        )
        # ... or compiled in place after it, or the wrapper compiled whole: laid out for that by the first
        # forward that finds one or is traced (DTensors only: dynamo fakes plain views of a flat buffer as
        # they are); the modules listed once, for a check per forward of ~10 us (holds_compiled_code's
        # test for torch.compile's wrapper costs 20x that)
        self._compilable = compiled or not any(isinstance(p, DTensor) for _, p in synced)
        self._submodules = tuple(module.modules())
        self._bucket_slots: list[list[ParamSlot]] = [[] for _ in self._buckets]
        # ZeRO-1 reduce-scatters each bucket, except where an all-reduce in place costs less (gloo)
        self._reduce_scatters = [self.zero_stage == 1 and not sync.reduces_by_all_reduce(b.data_parallel_group)
                                 for b in self._buckets]
        # all-reduced buckets are whole on every rank: an optimizer computes its norm without a collective
        for bucket, scatters in zip(self._buckets, self._reduce_scatters):
            bucket.reduced_whole = self.zero_stage < 2 and not scatters
        for slot in self._slots:
            self._bucket_slots[slot.bucket_index].append(slot)
            slot.dp_mesh_dim = sync.data_parallel_mesh_dim(slot.param, group_of[id(slot.param)])
            slot.scale = self._scale(slot.reduced_over)
        self._grad_shards = GradShards(self._buckets, self._bucket_slots) if self.zero_stage == 2 else None
        self._num_ready = [0] * len(self._buckets)
        self._next_bucket = 0
        self._works: list[dist.Work] = []
        self._micro_batch_open = False  # ZeRO-2: a bucket got a grad since the last micro-batch's reduction
        self._step_open = False
        self._callback_queued = False
        self._counters = SyncCounters(self.data_parallel_group, [f"{n}:{tuple(p.shape)}" for n, p in synced],
                                      enabled=detect_desync, micro=self, timeout=desync_timeout)
        self._carrier, self._carried = self._carry_check(trailing)
        self._step_waiter = _StepWaiter(self._counters)
        self._carried_work: tuple[dist.Work, tuple[int, ...]] | None = None
        self._closed = False
        self._hooks = []
        for slot in self._slots:
            self._hooks.append(slot.param.register_hook(self._make_pre_hook(slot)))
            self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._make_post_hook(slot)))
        # a parent module loading a state dict reaches us as a child: map its keys onto ``module.``
        self.register_load_state_dict_pre_hook(_add_module_prefix)
        module.__dict__[WRAPPED_MARK] = weakref.ref(self)

    # ------------------------------------------------------------------ the wrapped module
    def forward(self, *args, **kwargs):
        if not self._compilable and (torch.compiler.is_compiling() or any(map(compiled_in_place, self._submodules))):
            self._lay_out_for_compile()
        if torch.is_grad_enabled():
            self._check_still_frozen()
        self._counters.count_forward()
        return self.module(*args, **kwargs)

    @torch.compiler.disable  # (traced, as in torch.compile(ddp): a graph break, so that this runs eagerly)
    def _lay_out_for_compile(self) -> None:
        """Blocks compiled after wrapping (``block.compile()`` on the wrapped model) or the wrapper
        compiled whole: the DTensor params and grads in the flat buffers become views dynamo can fake,
        as wrapping compiled blocks lays them out from the start; grads already set are published again
        that way."""
        lay_out_for_compile(self._buckets, self._slots)
        for slot in self._slots:
            if slot.published is not None and slot.param.grad is slot.published:
                sync.publish(slot)
        self._compilable = True

    def _check_still_frozen(self) -> None:
        thawed = [name for name, p in self._frozen if p.requires_grad]
        if thawed:
            raise RuntimeError(
                f"parameters {thawed[:4]}{' and more' if len(thawed) > 4 else ''} had requires_grad=False when "
                "DDP wrapped the model and require grad now: DDP has no buffer or hook for them, so each rank "
                "would train them on its own grads. Set requires_grad before wrapping the model in DDP (to "
                "hold a param still for a while, leave it trainable and exclude it from the optimizer)"
            )

    def __getattr__(self, name: str):
        """Attributes the wrapper lacks are the wrapped module's (``ddp.transformer``, ``ddp.config``), as
        torch's ``get_state_dict(model, optimizer)`` and pipelining expect of a transparent wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # not set yet (inside __init__): nothing to forward to
                raise
            return getattr(self.module, name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped module's, names unchanged (no ``module.`` prefix)."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (same keys as without DDP); deep-copyable (see below)."""
        state_dict = self.module.state_dict(*args, **kwargs)
        for key, value in state_dict.items():
            state_dict[key] = _deep_copyable(value)
        return state_dict

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped module, in place (params stay views of DDP's buffers)."""
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would replace the parameters DDP has hooked and laid out in its "
                "buffers; load with assign=False, or load into the module before wrapping it"
            )
        return self.module.load_state_dict(state_dict, strict=strict)

    # ------------------------------------------------------------------ the contract
    @property
    def grad_reduction(self) -> GradReduction:
        """``"mean"`` (``average_grads=True``) or ``"sum"``: what synced grads are over the DP ranks."""
        return "mean" if self.average_grads else "sum"

    def grad_buckets(self) -> Sequence[GradBucket]:
        """Every bucket of every dtype, in the order their reductions are launched."""
        return tuple(self._buckets)

    def finish_grad_sync(self) -> None:
        """Launch what is not launched yet, wait for every bucket, reduce ``Partial`` grads over their
        (non-DP) mesh dims, and set each synced param's ``.grad``. Harmless to call twice.

        First the DP ranks agree that they ran the same forwards, backwards and syncs (``detect_desync``)."""
        self._finish(in_backward=False)

    def finish_grad_sync_for_step(self) -> StepWaiter | None:
        """:meth:`finish_grad_sync` for an optimizer whose step's only collectives run on groups apart
        from this wrapper's reductions and are waited for through the returned waiter (an ndweave
        ``DistributedOptimizer``'s parameter gathers on gloo; ``ndweave.mesh.contracts.CheckedStepSync``).

        The DP ranks' check before the step then rides those collectives: nothing is gathered for it;
        a rank that skipped the step or runs one more is named when the step's collectives wait, on
        every rank, as the check would have. ``None`` where the check after backward is not carried by
        the buckets either (NCCL, ZeRO-2, ``detect_desync=False``): the check ran as in
        :meth:`finish_grad_sync`."""
        if self._carried is None:
            self.finish_grad_sync()
            return None
        if self._step_open:
            self._finish(in_backward=False)
        else:
            self._counters.defer_step()
        return self._step_waiter

    def _finish(self, *, in_backward: bool) -> None:
        if not self._step_open:
            self._counters.finish_without_backward()
            return
        if self._carried is None:
            self._counters.finish_sync(in_backward=in_backward)
        if self._grad_shards is not None:  # ZeRO-2: the grads are in the shards, no .grad to set
            self._reduce_micro_batch()
            with torch.no_grad():
                self._grad_shards.reduce_partial()
            self._step_open = False
            return
        with torch.no_grad():
            for index in range(self._next_bucket, len(self._buckets)):
                self._launch(index, in_backward=in_backward)
            self._next_bucket = len(self._buckets)
            works, self._works = self._works, []
            if self._carried is not None:  # the rows came with the last bucket: compared before any grad is used
                (work, row), self._carried_work = self._carried_work, None
                self._counters.agree_carried(work, row, self._carried)
                self._counters.finish_sync(in_backward=in_backward, carried=True)
            for work in works:
                work.wait()
            sync.reduce_partial_slots(self._slots)
            for slot in self._slots:
                sync.publish(slot)
        self._step_open = False

    def zero_grad_buffer(self) -> None:
        """Zero every grad buffer and forget the step in progress; clears the ``.grad`` DDP set."""
        for work in self._works:
            work.wait()
        self._works, self._carried_work = [], None
        if self._grad_shards is not None:
            self._grad_shards.reset()
            self._micro_batch_open = False
        for buffer in self._grad_buffers:
            buffer.zero_()
        for slot in self._slots:
            grad = slot.param.grad
            if grad is not None and (grad is slot.published or grad is slot.local_view):
                slot.param.grad = None
            slot.published, slot.local_view, slot.fresh, slot.ready, slot.unscaled = None, None, True, False, False
        self._reset_counts()
        self._step_open = False

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Stop syncing: wait for the reductions in flight, remove the autograd hooks, and release the
        grad buffers. A ``.grad`` (and ``main_grad``) DDP handed out becomes the parameter's own copy,
        so the values stay and a later backward accumulates into them as without DDP; parameters
        keep their values (with a distributed optimizer, in the buffer they were laid out in). The
        module may be wrapped again. Call it on every DP rank; a second call does nothing.
        ``with DDP(model, mesh["DP"]) as model:`` and ``ndweave.mesh.shutdown(model)`` call it too."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        works, self._works = self._works, []
        for work in works:
            work.wait()
        if self._grad_shards is not None:
            self._grad_shards.reset()
        for slot in self._slots:
            _detach_from_buffers(slot)
        self._buckets, self._slots, self._bucket_slots, self._grad_buffers = [], [], [], []
        self._grad_shards, self._reduce_scatters = None, []
        self._carrier = self._carried = self._carried_work = None
        self._reset_counts()
        self._step_open = self._callback_queued = self._micro_batch_open = False
        self._counters.close()
        mark = self.module.__dict__.get(WRAPPED_MARK)
        if mark is not None and mark() is self:
            del self.module.__dict__[WRAPPED_MARK]

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ backward hooks
    def _make_pre_hook(self, slot: ParamSlot):
        def pre_hook(grad: torch.Tensor) -> None:
            # Runs before autograd accumulates into ``.grad``: the moment to start a step, so that the
            # previous step's ``.grad`` can be taken out of autograd's way first.
            if self._grad_shards is not None and self._counters.is_new_backward():
                # ZeRO-2 waits for its reductions within this backward: the DP ranks agree before that
                self._counters.agree_before_backward()
            if self._step_open and slot.bucket_index < self._next_bucket:
                if self._grad_shards is not None:  # ZeRO-2: reduce what came so far, then go on adding
                    self._reduce_micro_batch()
                else:  # a second backward after this bucket was reduced (no no_sync): close that step
                    self._finish(in_backward=True)
            if not self._step_open:
                self._start_step()
            sync.take_local(slot)  # (after a no_sync micro-batch: the .grad view, or the user's zero_grad)
            self._counters.count_backward()

        return pre_hook

    def _make_post_hook(self, slot: ParamSlot):
        def post_hook(param: torch.nn.Parameter) -> None:
            grad = param.grad
            if grad is None:
                return
            sharded = self._grad_shards is not None
            local = not self.is_last_microbatch and not sharded  # ZeRO-2 reduces every micro-batch
            with torch.no_grad():
                if sharded:
                    self._grad_shards.open(slot.bucket_index)
                    self._micro_batch_open = True
                sync.accumulate(slot, grad, self, local=local)
            param.grad = None
            if local:
                sync.publish_local(slot)
                return
            if (self.finish_grad_sync_in_backward or sharded) and not self._callback_queued:
                self._callback_queued = True
                queue_backward_callback(self._finish_at_backward_end)
            if not slot.ready:
                slot.ready = True
                self._num_ready[slot.bucket_index] += 1
                if self.overlap_grad_reduce:
                    self._launch_ready_buckets()

        return post_hook

    def _finish_at_backward_end(self) -> None:
        self._callback_queued = False
        if self._grad_shards is not None:
            self._reduce_micro_batch()
            if not (self.is_last_microbatch and self.finish_grad_sync_in_backward):
                return
        self._finish(in_backward=True)

    def _reduce_micro_batch(self) -> None:
        """ZeRO-2, at the end of a backward: launch the buckets it left, wait for every reduction (the
        full-size buffers are freed) and count the next micro-batch from zero."""
        if self._micro_batch_open:
            with torch.no_grad():
                for index in range(self._next_bucket, len(self._buckets)):
                    self._launch(index)
                self._grad_shards.wait()
        self._micro_batch_open = False
        self._reset_counts()
        for slot in self._slots:
            slot.ready = False

    def _start_step(self) -> None:
        self._step_open = True
        self._callback_queued = False  # (one queued by a backward that raised never ran)
        self._reset_counts()
        self._counters.start_sync()
        if self._grad_shards is not None:
            self._grad_shards.start_step()
        with torch.no_grad():
            for slot in self._slots:
                sync.start_step(slot, carry=not self.use_distributed_optimizer, ddp=self,
                                local=not self.is_last_microbatch)

    def _reset_counts(self) -> None:
        self._num_ready = [0] * len(self._buckets)
        self._next_bucket = 0

    # ------------------------------------------------------------------ collectives
    def _launch_ready_buckets(self) -> None:
        # Strictly in bucket order: every rank must issue the same collectives in the same order.
        while (
            self._next_bucket < len(self._buckets)
            and self._num_ready[self._next_bucket] == len(self._bucket_slots[self._next_bucket])
        ):
            with torch.no_grad():
                self._launch(self._next_bucket, in_backward=self.finish_grad_sync_in_backward)
            self._next_bucket += 1

    def _launch(self, index: int, *, in_backward: bool = True) -> None:
        """Launch bucket ``index``'s reduction; the last one carries the check's rows (``in_backward``:
        whether the sync it ends will be finished in backward, which the rows tell)."""
        op = dist.ReduceOp.AVG if self.average_in_collective else dist.ReduceOp.SUM
        if self._grad_shards is not None:
            self._grad_shards.launch(index, op)
            return
        for slot in self._bucket_slots[index]:
            sync.settle_local(slot)  # a no_sync sum no synced micro-batch scaled, or that the user zeroed
            if slot.fresh:  # no grad this step (unused param): its region still holds old values
                slot.main_grad.zero_()
                slot.fresh = False
        bucket = self._buckets[index]
        if bucket.data_parallel_group is None:
            return
        if self._reduce_scatters[index]:
            start, end = bucket.shard_range()
            work = sync.reduce_scatter(bucket.grad_data[start:end], bucket.grad_data, op, bucket.data_parallel_group)
        elif self._carried is not None and index == len(self._buckets) - 1:
            row = self._counters.sync_row(in_backward=in_backward)
            self._carried.write(row)
            work = dist.all_reduce(self._carrier, op=op, group=bucket.data_parallel_group, async_op=True)
            self._carried_work = work, row
        else:
            work = dist.all_reduce(bucket.grad_data, op=op, group=bucket.data_parallel_group, async_op=True)
        self._works.append(work)

    def _carry_check(self, trailing: int) -> tuple[torch.Tensor | None, CarriedRows | None]:
        """The last bucket and the rows after it (``trailing`` elements of the last grad buffer), all-reduced
        as one tensor, when that bucket is a sum over exactly the DP ranks the check compares; else
        ``(None, None)``: the check gathers its rows on a side group of its own (``desync.py``).

        Why: on gloo a gather of a few ints costs the busiest rank as much CPU as a bucket's reduction
        (0.4 ms at 2 ranks, 1.2 ms at 4 sharing 2 cores); carried, it costs a few hundred bytes more
        in a message sent anyway. Each rank writes its row in its own slot, so the sum is the gather."""
        if not trailing or not self._buckets:
            return None, None
        bucket, buffer = self._buckets[-1], self._grad_buffers[-1]
        ranks = self._counters.ranks
        if (bucket.data_parallel_group is None or self._reduce_scatters[-1] or bucket.grad_data.device.type != "cpu"
                or dist.get_process_group_ranks(bucket.data_parallel_group) != ranks):
            return None, None
        start = bucket.grad_data.storage_offset() - buffer.storage_offset()
        rows = CarriedRows(buffer[-trailing:], ranks.index(dist.get_rank()), len(ranks), ROW_WIDTH)
        return buffer[start:], rows

    def _scale(self, reduced_over: int) -> float:
        """Factor applied to the grads of a bucket summed over ``reduced_over`` ranks as they are
        accumulated (before any Partial-on-DP correction): averaging divides by every rank that splits
        the batch (DP x EP), whatever the bucket's group; ``ReduceOp.AVG`` divides by that group's size
        itself, so then only the rest is applied here."""
        if not self.average_grads or self.data_parallel_group is None:
            return 1.0
        return (reduced_over if self.average_in_collective else 1) / self.data_parallel_size


DDP = DistributedDataParallel


class _StepWaiter:
    """What :meth:`DistributedDataParallel.finish_grad_sync_for_step` hands an optimizer: its step's
    collectives waited for as a desync check waits (``desync.SyncCounters.wait_step``)."""

    def __init__(self, counters: SyncCounters) -> None:
        self._counters = counters

    def wait(self, work: dist.Work, tensors: Sequence[torch.Tensor]) -> None:
        self._counters.wait_step(work, list(tensors))


def _detach_from_buffers(slot: ParamSlot) -> None:
    """Make a ``.grad`` or ``main_grad`` of ``slot``'s parameter that lies in DDP's buffers its own copy."""
    param, grad = slot.param, slot.param.grad
    if grad is not None and (grad is slot.published or grad is slot.local_view):
        param.grad = grad.clone()
    main = getattr(param, "main_grad", None)
    if main is not None and main is slot.published_main:  # one tensor with .grad where the dtypes match
        param.main_grad = param.grad if grad is main else main.clone()
    slot.published = slot.local_view = slot.local_main = slot.published_main = slot.partial_grad = None
    slot.main_grad = slot.grad = None


def _deep_copyable(value):
    """A detached DTensor param over ``param_data`` sits at a storage offset, which torch's deepcopy of
    a DTensor cannot handle: the same DTensor, built with ``dtensor_over``. Params (keep_vars) stay."""
    if not isinstance(value, DTensor) or isinstance(value, torch.nn.Parameter):
        return value
    local = local_tensor(value)
    if local.storage_offset() == 0:
        return value
    return dtensor_over(local, value.device_mesh, value.placements, value.shape, value.stride())


def _add_module_prefix(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Load pre-hook: a parent loading into a DDP child passes keys without ``module.``; add it."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
