"""Finishing gradient synchronization before an optimizer step.

Two things can leave a gradient unfinished after ``backward()``:

* data parallelism (DDP) has bucketed reductions in flight;
* tensor/sequence parallelism leaves ``Partial`` DTensor grads, e.g. a replicated LayerNorm weight
  fed a sequence-sharded activation gets a partial sum per rank.

Anything that owns such work implements :class:`GradSyncable`; optimizers call
:func:`finish_grad_sync` on their models once per step. An optimizer whose step's only collectives
run on groups of their own and are waited through the wrapper (a sharded optimizer's parameter
gathers) calls :func:`finish_grad_sync_for_step` instead: a wrapper that checks its ranks agree before
each step (:class:`CheckedStepSync`, ndweave's DDP) then carries that check by those collectives,
without one of its own. :func:`reduce_partial_grads` is the one
implementation of the ``Partial -> Replicate`` reduction, bucketed so a step costs one collective per
bucket rather than one per parameter (or worse, one per optimizer op, which is what torch does when
an optimizer meets a ``Partial`` grad).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from ndweave.mesh.torch_compat import local_tensor

__all__ = ["CheckedStepSync", "GradSyncable", "StepWaiter", "finish_grad_sync", "finish_grad_sync_for_step",
           "reduce_partial_grads", "DEFAULT_PARTIAL_BUCKET_NUMEL"]

#: Elements per bucket for partial-grad reduction (64 MiB of fp32).
DEFAULT_PARTIAL_BUCKET_NUMEL = 2**24


@runtime_checkable
class GradSyncable(Protocol):
    """A model wrapper whose grads need finishing before a step (DDP, DModule).

    Contract: after ``finish_grad_sync()`` returns, every parameter's ``.grad`` is fully reduced:
    no ``Partial`` placements remain and data-parallel reduction is complete (with a sharded
    optimizer, complete on this rank's shard of each bucket). Calling it twice is harmless.
    """

    def finish_grad_sync(self) -> None: ...


def finish_grad_sync(models: Iterable[torch.nn.Module]) -> None:
    """Finish pending grad syncs of ``models``: what an optimizer calls before stepping.

    A ``GradSyncable`` model finishes its own; any other module gets its ``Partial`` grads reduced.
    """
    for model in models:
        if isinstance(model, GradSyncable):
            model.finish_grad_sync()
        else:
            reduce_partial_grads(model.parameters())


@runtime_checkable
class StepWaiter(Protocol):
    """How an optimizer's step waits for its collectives, given by :class:`CheckedStepSync`."""

    def wait(self, work: dist.Work, tensors: Sequence[torch.Tensor]) -> None:
        """Wait for ``work`` (a collective of the step, on a group apart from the wrapper's reductions;
        ``tensors``: those it reads or writes), bounded, raising on every rank the wrapper's error
        when its ranks did not all come to this step."""
        ...


@runtime_checkable
class CheckedStepSync(GradSyncable, Protocol):
    """A :class:`GradSyncable` wrapper that checks its ranks agree before each optimizer step (that
    none skipped a step or runs one more) and can carry that check by the step's own collectives."""

    def finish_grad_sync_for_step(self) -> StepWaiter | None:
        """As ``finish_grad_sync()``, called by an optimizer whose every collective in the step runs on
        a group that carries none of the wrapper's reductions and is waited for through the returned
        waiter; ``None``: the wrapper checked as ``finish_grad_sync()`` does (wait as usual)."""
        ...


def finish_grad_sync_for_step(models: Iterable[torch.nn.Module]) -> list[StepWaiter | None]:
    """:func:`finish_grad_sync` for an optimizer whose step's only collectives run on groups apart from
    the models' reductions, each waited for through the waiter of the model it belongs to (in the
    order of ``models``; ``None`` where a model gives none: wait as usual)."""
    waiters: list[StepWaiter | None] = []
    for model in models:
        if isinstance(model, CheckedStepSync):
            waiters.append(model.finish_grad_sync_for_step())
        else:
            finish_grad_sync([model])
            waiters.append(None)
    return waiters


def reduce_partial_grads(
    params: Iterable[torch.nn.Parameter], *, bucket_numel: int = DEFAULT_PARTIAL_BUCKET_NUMEL
) -> list[torch.nn.Parameter]:
    """All-reduce every ``Partial`` DTensor grad in ``params`` in place; they become ``Replicate``.

    Grads sharing a mesh, placements and dtype are packed into buckets of at most ``bucket_numel``
    elements: one all-reduce per bucket per partial mesh dim. The reduced values are written back
    into each grad's existing local tensor, so a grad that is a view into a DDP buffer stays one.
    Returns the parameters whose grads were reduced.
    """
    groups: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    seen: set[int] = set()
    for p in params:
        g = p.grad
        if id(p) in seen or not isinstance(g, DTensor) or not any(pl.is_partial() for pl in g.placements):
            continue
        seen.add(id(p))
        groups[(g.device_mesh, tuple(g.placements), g.dtype)].append(p)

    reduced: list[torch.nn.Parameter] = []
    for (mesh, placements, _dtype), members in groups.items():
        for bucket in _buckets(members, bucket_numel):
            locals_ = [local_tensor(p.grad) for p in bucket]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            for mesh_dim, pl in enumerate(placements):
                if pl.is_partial():
                    _all_reduce(flat, pl, mesh.get_group(mesh_dim))
            offset = 0
            for t in locals_:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            new_placements = [Replicate() if pl.is_partial() else pl for pl in placements]
            for p, t in zip(bucket, locals_):
                p.grad = DTensor.from_local(t, mesh, new_placements, run_check=False, shape=p.shape, stride=p.stride())
            reduced.extend(bucket)
    return reduced


def _buckets(params: list[torch.nn.Parameter], bucket_numel: int) -> Iterable[list[torch.nn.Parameter]]:
    bucket, size = [], 0
    for p in params:
        n = local_tensor(p.grad).numel()
        if bucket and size + n > bucket_numel:
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += n
    if bucket:
        yield bucket


def _all_reduce(flat: torch.Tensor, placement: Partial, group: dist.ProcessGroup) -> None:
    op = getattr(placement, "reduce_op", "sum")
    if op == "sum":
        dist.all_reduce(flat, group=group)
    elif op == "avg":  # gloo has no AVG: sum, then divide
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
    elif op in ("max", "min"):
        dist.all_reduce(flat, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
    else:
        raise NotImplementedError(f"Partial({op!r}) grads cannot be reduced; supported: sum, avg, max, min")
