"""Per-parameter steps of a data-parallel grad sync: accumulate, carry, reduce Partial, publish.

The order within a step (linear ops commute, so this equals reducing each micro-batch's grads):

1. each micro-batch's grad is accumulated into the param's region of the bucket's flat buffer,
   scaled by ``slot.scale`` (``1/dp_size`` when averaging); a grad that is ``Partial`` on a non-DP
   mesh dim is accumulated as its local partial value, unreduced;
2. the bucket is all-reduced (or reduce-scattered, see :func:`reduces_by_all_reduce`) over the
   data-parallel group;
3. ``finish_grad_sync`` reduces the still-``Partial`` regions over their own mesh dims, once per
   step and bucketed, with :func:`ndweave.mesh.contracts.reduce_partial_grads`;
4. ``.grad`` is set to a view of the buffer (a DTensor with the param's placements where the param
   is one), or a cast copy when the buffer is fp32 and the param is not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.ddp.buffer import ParamSlot
from ndweave.mesh.collectives import reduce_scatter_flat
from ndweave.mesh.contracts import reduce_partial_grads
from ndweave.mesh.torch_compat import dtensor_over, flatten_dense_tensors, local_tensor, unflatten_dense_tensors

__all__ = [
    "accumulate",
    "broadcast_from_first",
    "data_parallel_mesh_dim",
    "partial_placements",
    "publish",
    "publish_local",
    "reduce_partial_slots",
    "reduce_scatter",
    "reduces_by_all_reduce",
    "settle_local",
    "start_step",
    "take_local",
]

_BROADCAST_BYTES = 2**26


def data_parallel_mesh_dim(param: torch.nn.Parameter, group: dist.ProcessGroup | None) -> int | None:
    """The dim of a DTensor param's mesh that spans exactly the data-parallel group, if any.

    Such a param must be ``Replicate`` on it (a param sharded over DP is FSDP's business, not DDP's).
    """
    if group is None or not isinstance(param, DTensor):
        return None
    mesh, ranks = param.device_mesh, dist.get_process_group_ranks(group)
    for i in range(mesh.ndim):
        if mesh.size(i) == len(ranks) and dist.get_process_group_ranks(mesh.get_group(i)) == ranks:
            if not param.placements[i].is_replicate():
                raise ValueError(
                    f"a parameter is {param.placements[i]} on mesh dim {i}, the data-parallel dim; DDP needs "
                    "params replicated over DP (shard them over DP with FSDP or a sharded optimizer instead)"
                )
            return i
    return None


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Copy ``tensors`` (their local shards) from DP rank 0 to the rest of ``group``, coalesced."""
    src = dist.get_global_rank(group, 0)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        local = local_tensor(t)
        if local.numel():
            by_kind.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for members in by_kind.values():
            chunk, size = [], 0
            for t in members + [None]:
                if t is not None:
                    chunk.append(t)
                    size += t.numel() * t.element_size()
                if chunk and (t is None or size >= _BROADCAST_BYTES):
                    flat = flatten_dense_tensors(chunk)
                    dist.broadcast(flat, src=src, group=group)
                    for dst, value in zip(chunk, unflatten_dense_tensors(flat, chunk)):
                        dst.copy_(value)
                    chunk, size = [], 0


def reduces_by_all_reduce(group: dist.ProcessGroup | None) -> bool:
    """Whether a sharded optimizer's reduce-scatter over ``group`` is done as an in-place all-reduce of
    the whole bucket instead (this rank then reads its range; the other ranges are reduced too).

    On gloo it is: gloo's reduce-scatter copies its whole input on the calling thread before it starts
    (1-1.5 ms of backward for a 4 MB bucket, against 0.2 ms to launch an all-reduce), spends more CPU
    than an all-reduce of the same bucket at 2 ranks and no less at 4, and holds that copy until it is
    waited for, where the all-reduce works in place. NCCL's reduce-scatter moves half an all-reduce's
    bytes and copies nothing: kept (so is any other backend's, a mixed ``cpu:gloo,cuda:nccl`` one's too)."""
    return group is not None and dist.get_backend(group) == "gloo"


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op, group) -> dist.Work:
    """Async reduce-scatter of ``input`` into ``output`` (this rank's range of it; in place is fine)."""
    return reduce_scatter_flat(output, input, op=op, group=group, async_op=True)


def start_step(slot: ParamSlot, *, carry: bool, ddp, local: bool) -> None:
    """Before the first grad of a step: take the last step's ``.grad`` out of autograd's way.

    A ``.grad`` still set (torch semantics: grads add up until zeroed) is carried: its value is put in
    the buffer divided by what the sync will multiply it by, so it comes out unchanged and this step's
    reduced grads are added to it. Without one the region is stale and the first grad overwrites it.
    ``local``: the step starts with a ``no_sync`` micro-batch, whose sums stay unscaled (see
    :func:`accumulate`), so the carried value is divided by ``scale`` too.
    """
    slot.ready = False
    slot.unscaled = False
    slot.local_view = None
    param = slot.param
    old = param.grad
    if old is None:
        slot.fresh = True
        return
    param.grad = None
    if not carry:
        slot.fresh = True
        return
    if isinstance(old, DTensor) and tuple(old.placements) != tuple(param.placements):
        old = old.redistribute(old.device_mesh, param.placements)
    value = local_tensor(old)
    if value.data_ptr() != slot.main_grad.data_ptr():
        slot.main_grad.copy_(value)
    slot.main_grad.mul_(_carry_scale(slot, ddp) / (slot.scale if local else 1.0))
    slot.unscaled = local
    slot.fresh = False


def accumulate(slot: ParamSlot, grad: torch.Tensor, ddp, *, local: bool = False) -> None:
    """Add one micro-batch's ``grad`` into the slot's region of the buffer (copy if it is the first).

    ``local`` (a ``no_sync`` micro-batch): added unscaled, so that the region is the local sum torch's
    DDP would have in ``.grad`` (:func:`publish_local`); the first synced micro-batch, or the launch
    (:func:`settle_local`), multiplies the sum by ``scale`` once."""
    if isinstance(grad, DTensor):
        if slot.grad_placements is None:
            _fix_grad_placements(slot, grad, ddp)
        if tuple(grad.placements) != slot.grad_placements and _differ(grad, slot.grad_placements):
            grad = grad.redistribute(grad.device_mesh, slot.grad_placements)
        grad = local_tensor(grad)
    main = slot.main_grad
    if local and not slot.fresh and not slot.unscaled:
        local = False  # a synced micro-batch came first in this step (overlap off): go on scaled
    if not local and slot.unscaled:
        main.mul_(slot.scale)
        slot.unscaled = False
    scale = 1.0 if local else slot.scale
    if not slot.fresh:
        main.add_(grad, alpha=scale)
    elif scale == 1.0:
        main.copy_(grad)
    elif grad.dtype == main.dtype:
        torch.mul(grad, scale, out=main)
    else:  # scale in the (wider) buffer dtype
        main.copy_(grad).mul_(scale)
    slot.fresh = False
    slot.unscaled = local


def publish_local(slot: ParamSlot) -> None:
    """After a ``no_sync`` micro-batch: ``.grad`` is a view of the local sum in the buffer, as torch's
    DDP has it (a torch optimizer stepping there steps on local grads, as with torch's DDP). Where the
    buffer is wider than the param (fp32 grads of a bf16 param) no view can be handed out and ``.grad``
    stays ``None``, as in Megatron."""
    param = slot.param
    if not slot.unscaled or slot.main_grad.dtype != param.dtype:
        return
    if slot.local_main is None:
        slot.local_main = slot.main_grad
        if isinstance(param, DTensor):
            slot.local_main = _view_as_dtensor(slot, slot.grad_placements or param.placements)
    param.grad = slot.local_view = slot.local_main


def take_local(slot: ParamSlot) -> None:
    """Take back the ``.grad`` :func:`publish_local` handed out, before autograd or the sync touch the
    region. Still there: the sum goes on in the buffer. Set to ``None`` (a ``zero_grad()``): the local
    sum is dropped, as torch's would be. Replaced by another tensor: that tensor is the local sum."""
    view, slot.local_view = slot.local_view, None
    if view is None:
        return
    grad, slot.param.grad = slot.param.grad, None
    if grad is view:
        return
    if grad is None:
        slot.fresh, slot.unscaled = True, False
        return
    slot.main_grad.copy_(local_tensor(grad))
    slot.fresh, slot.unscaled = False, True


def settle_local(slot: ParamSlot) -> None:
    """Before the launch: a local sum no synced micro-batch scaled yet is scaled now."""
    take_local(slot)
    if slot.unscaled and not slot.fresh:
        slot.main_grad.mul_(slot.scale)
    slot.unscaled = False


def _fix_grad_placements(slot: ParamSlot, grad: DTensor, ddp) -> None:
    """Choose the placements grads of ``slot`` accumulate in, from the first one seen.

    ``Partial`` is kept where the param is ``Replicate`` (reduced later, bucketed); anything else is
    redistributed to the param's placement. ``Partial(sum)`` on the DP dim means the grad is a share
    of the global-batch grad: it must be summed over DP, not averaged, so its scale is raised by DP.
    """
    param, mesh = slot.param, grad.device_mesh
    placements = []
    for i, (p_pl, g_pl) in enumerate(zip(param.placements, grad.placements)):
        keep = g_pl.is_partial() and p_pl.is_replicate() and mesh.size(i) > 1  # Partial over 1 rank: done
        if i == slot.dp_mesh_dim:
            keep = keep and getattr(g_pl, "reduce_op", "sum") == "sum"
        placements.append(g_pl if keep else p_pl)
    slot.grad_placements = tuple(placements)
    if slot.dp_mesh_dim is not None and placements[slot.dp_mesh_dim].is_partial() and ddp.average_grads:
        slot.scale = ddp._scale(slot.reduced_over) * ddp.data_parallel_size


def _differ(grad: DTensor, placements: tuple) -> bool:
    """Whether ``grad``'s local tensor differs from one laid out as ``placements`` (size-1 mesh dims,
    e.g. a DP dim of size 1, hold the same local tensor whatever their placement)."""
    mesh = grad.device_mesh
    return any(have != want and mesh.size(i) > 1 for i, (have, want) in enumerate(zip(grad.placements, placements)))


def _carry_scale(slot: ParamSlot, ddp) -> float:
    """1 / (factor by which the sync multiplies a value identical on every rank)."""
    scale = 1.0
    if not ddp.average_in_collective:
        scale /= slot.reduced_over  # summed over the bucket's group (averaging scales new grads only)
    if slot.grad_placements is not None:
        mesh = slot.param.device_mesh
        for i, pl in enumerate(slot.grad_placements):
            if i != slot.dp_mesh_dim and pl.is_partial() and getattr(pl, "reduce_op", "sum") == "sum":
                scale /= mesh.size(i)
    return scale


def partial_placements(slot: ParamSlot) -> list | None:
    """The placements of the slot's accumulated (DP-reduced) grad when one is ``Partial`` on a non-DP
    mesh dim, still to be reduced there; ``None`` when none is (or no grad came yet)."""
    if slot.grad_placements is None:
        return None
    placements = [slot.param.placements[i] if i == slot.dp_mesh_dim else pl for i, pl in enumerate(slot.grad_placements)]
    return placements if any(pl.is_partial() for pl in placements) else None


def reduce_partial_slots(slots: list[ParamSlot]) -> None:
    """Reduce every slot whose grad is ``Partial`` on a non-DP mesh dim, in place in the buffer."""
    todo = []
    for slot in slots:
        if slot.grad_placements is None:
            continue
        if slot.partial_grad is None:
            placements = partial_placements(slot)
            if placements is None:
                continue
            slot.partial_grad = _view_as_dtensor(slot, placements)
        slot.grad = slot.partial_grad
        todo.append(slot)
    if todo:
        # the slots stand in for params: reduce_partial_grads writes into each grad's local tensor,
        # which is the slot's view of the bucket, so the result lands in the buffer
        reduce_partial_grads(todo)
        for slot in todo:
            slot.grad = None


def publish(slot: ParamSlot) -> None:
    """Set ``param.grad`` (and ``param.main_grad``) from the slot's reduced region of the buffer."""
    param = slot.param
    if slot.published_main is None:
        main = slot.main_grad
        if isinstance(param, DTensor):
            main = _view_as_dtensor(slot, param.placements)
        slot.published_main = main
        param.main_grad = main
    main = slot.published_main
    grad = main if main.dtype == param.dtype else main.to(param.dtype)
    param.grad = grad
    slot.published = grad
    slot.local_view = None


def _view_as_dtensor(slot: ParamSlot, placements) -> DTensor:
    param = slot.param
    # dtensor_over, not from_local: a DTensor over a view at an offset of the buffer cannot be deep-copied
    return dtensor_over(slot.main_grad, param.device_mesh, placements, param.shape, param.stride(),
                        compilable=slot.compilable)
