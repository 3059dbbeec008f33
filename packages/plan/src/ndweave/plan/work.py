"""What a region of a program asks of a machine, counted while it runs (on meta: nothing computed).

:class:`WorkCounter` counts ops, FLOPs, bytes and collectives per region, split into forward and
backward; :class:`ndweave.plan.calibrate.Machine` turns a :class:`Work` into seconds::

    with WorkCounter() as counter:
        loss_fn(model(x), y).backward()            # on meta: counted, not computed
    counter.work["all"].forward.flops, counter.work["all"].backward.collectives
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from ndweave.mesh.torch_compat import (FakeTensor, TorchDispatchMode, current_backward_id, flash_attention_cpu_ops,
                                        tree_flatten)

__all__ = ["PhasedWork", "Work", "WorkCounter"]

# collectives as torch's functional collectives (what DTensor issues) name them, and the bytes that
# travel: the whole (gathered / reduced) buffer; see collective_seconds
_COLLECTIVES = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast", "shard_dim_alltoall": "all_to_all",
}
# what a kernel never runs for: shape and layout questions
_METADATA = {"is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense", "size", "sym_size",
             "stride", "sym_stride", "storage_offset", "sym_storage_offset", "numel", "sym_numel", "dim", "layout",
             "device", "wait_tensor",
             # what saved-tensor hooks (a memory trace's) dispatch per saved tensor; autograd's own saving
             # dispatches none, so a checkpointed layer would look cheaper than its trace without
             "detach"}


@dataclass
class Work:
    """What a region of a program asks of a machine (one rank's share: DTensors' local ops)."""

    ops: int = 0
    """Ops dispatched on plain (local) tensors, metadata queries left out; each pays the host's
    overhead (:attr:`Machine.op_overhead_s`)."""
    dtensor_ops: int = 0
    """Ops dispatched on DTensors (each also runs as local ops, counted in ``ops``). Another dispatch
    mode above the counter that steps aside for DTensor (torch's ``MemTracker`` does) hides them:
    then only their local ops are seen."""
    flops: float = 0.0
    """FLOPs of the ops torch's flop counter has formulas for (matmuls, convolutions, attention), at
    their local shapes."""
    bytes: float = 0.0
    """Bytes the other ops read and write (inputs plus outputs; views move none)."""
    collectives: list[tuple[str, int, str]] = field(default_factory=list)
    """``(kind, bytes, group name)`` of each collective (kinds of :func:`collective_seconds`)."""

    def __add__(self, other: Work) -> Work:
        return Work(self.ops + other.ops, self.dtensor_ops + other.dtensor_ops, self.flops + other.flops,
                    self.bytes + other.bytes, self.collectives + other.collectives)


@dataclass
class PhasedWork:
    """One region's work in forward and in backward (autograd's engine running)."""

    forward: Work = field(default_factory=Work)
    backward: Work = field(default_factory=Work)

    @property
    def total(self) -> Work:
        return self.forward + self.backward


class WorkCounter(TorchDispatchMode):
    """Counts the :class:`Work` of what runs inside it (works on meta tensors: nothing is computed),
    split into regions named by :meth:`region` (default ``"all"``) and, within each, forward and
    backward::

        with WorkCounter() as counter:
            for i, chunk in enumerate(chunks):
                counter.region(i)
                out = chunk(x)
                out.sum().backward()
        counter.work[0].forward.flops, counter.work[0].backward.collectives

    DTensor ops are counted once as DTensor ops and then seen again as the local ops and collectives
    DTensor turns them into (the counter steps aside for DTensor, as torch's ``CommDebugMode`` does),
    so FLOPs and bytes are each rank's own. FLOPs use ``FlopCounterMode``'s formulas (which, given
    DTensors, would count the global shapes). An op without a formula is decomposed, as
    ``FlopCounterMode`` does, and counted as what it decomposes into. Ops on fake tensors, or making
    them, are not counted: they are DTensor's shape propagation (on a sharding it has not cached yet),
    not work."""

    def __init__(self) -> None:
        super().__init__()
        self.work: dict = defaultdict(PhasedWork)
        self._region = "all"
        self._formulas = dict(FlopCounterMode(display=False).flop_registry)
        # CPU's flash attention has no formula of its own in torch's counter; its math is sdpa's
        for cpu, like in flash_attention_cpu_ops().items():
            if like in self._formulas:
                self._formulas.setdefault(cpu, self._formulas[like])

    def region(self, name) -> None:
        """Count what runs from now on under ``name``."""
        self._region = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        if packet is None:  # a higher-order operator: what it runs comes back here
            return func(*args, **kwargs)
        name = packet.__name__
        if name in _METADATA:
            return func(*args, **kwargs)
        inputs = _tensors((args, kwargs))  # flattened once: a trace dispatches thousands of ops
        if any(isinstance(t, FakeTensor) for t in inputs):
            return func(*args, **kwargs)
        if any(_is_dtensor(t) for t in types):
            self._current().dtensor_ops += 1
            return NotImplemented  # DTensor runs it as local ops and collectives, which come back here
        if packet not in self._formulas and name not in _COLLECTIVES:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        if any(isinstance(t, FakeTensor) for t in outputs):  # a factory inside DTensor's shape propagation
            return out
        work = self._current()
        work.ops += 1
        if name in _COLLECTIVES:
            tensors = outputs if _COLLECTIVES[name] == "all_gather" else _tensors(args)
            group = next((a for a in (*args, *kwargs.values()) if isinstance(a, str) and a not in _REDUCE_OPS), "")
            work.collectives.append((_COLLECTIVES[name], sum(_nbytes(t) for t in tensors), group))
        elif packet in self._formulas:
            work.flops += self._formulas[packet](*args, **kwargs, out_val=out)
        elif not func.is_view:
            work.bytes += sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
        return out

    def _current(self) -> Work:
        phased = self.work[self._region]
        return phased.backward if current_backward_id() != -1 else phased.forward


_REDUCE_OPS = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"}


def _is_dtensor(cls: type) -> bool:
    from torch.distributed.tensor import DTensor

    return issubclass(cls, DTensor)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
