"""Weights that live on several stages (a tied embedding and LM head): finding them, keeping their
copies equal, and summing their gradients across stages before any data-parallel sync.

How the sum is taken, whatever wraps the chunks: while the schedule runs, a tensor hook on each copy
adds up the gradients arriving for it (this rank's share of the weight's gradient). The holders then
swap those sums point-to-point over the PP group (no new process groups), and each hands *the other
copies' sum* to its own copy through one more ``autograd.backward`` (through a view of the
parameter). To a data-parallel wrapper that is just one more backward: it accumulates it like any
micro-batch and, told it is the last, launches its sync. So each copy ends with
``reduce_over_DP(sum over stages)``, the single-device gradient, whether the wrapper keeps grads in
``.grad`` or in its own buckets (sharded for ZeRO or not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ndweave.mesh.contracts import DataParallelWrapper, mark_tied_replica
from ndweave.mesh.torch_compat import local_tensor

__all__ = ["SharedParam", "find_shared_params", "HookGate", "TiedGradSync"]


@dataclass(frozen=True)
class SharedParam:
    """One weight held by several stages."""

    fqns: tuple[str, ...]
    """Every FQN the weight has in the whole model, by stage: ``fqns[0]`` is on the first stage."""
    stages: tuple[int, ...]
    """The stages holding a copy, increasing; the first one's copy is the one counted in grad norms."""


def find_shared_params(model: nn.Module, stage_layers: list[list[str]], shared_modules: Sequence[Sequence[str]],
                       copies: Mapping[str, Sequence[int]] | None = None) -> list[SharedParam]:
    """Weights on two or more stages: one tensor under several FQNs, the groups the plan lists, and
    ``copies`` (parameter FQN -> the stages holding it, where the traced forward uses it on several)."""
    copies = copies or {}
    groups: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(fqn)
    merged = [names for names in groups.values() if len(names) > 1 or any(n in copies for n in names)]
    for group in shared_modules:
        merged.extend(_pair_params(model, group))
    merged = _union(merged)
    stage_of = {fqn: s for s, layers in enumerate(stage_layers) for fqn in layers}
    shared = []
    for names in merged:
        stage_of_name = {fqn: stage_of[layer] for fqn in names for layer in stage_of if fqn.startswith(layer + ".")}
        for fqn in names:  # a parameter of the root's or a borrowed layer's: its first holder
            if fqn in copies:
                stage_of_name.setdefault(fqn, min(copies[fqn]))
        stages = sorted(set(stage_of_name.values()) | {s for fqn in names for s in copies.get(fqn, ())})
        if len(stages) > 1:  # names on the first stage first: the counted copy's name is fqns[0]
            names = sorted(names, key=lambda fqn: stage_of_name.get(fqn, stages[-1]))
            shared.append(SharedParam(tuple(names), tuple(stages)))
    return shared


def _pair_params(model: nn.Module, group: Sequence[str]) -> list[list[str]]:
    """A group of FQNs as groups of parameter FQNs: parameters as given, modules' parameters paired
    by their names inside the module (``wte`` + ``lm_head`` -> ``wte.weight`` + ``lm_head.weight``)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if all(fqn in params for fqn in group):
        return [list(group)]
    locals_ = [{n for n, _ in model.get_submodule(fqn).named_parameters(remove_duplicate=False)} for fqn in group]
    common = sorted(set.intersection(*locals_))
    if not common:
        raise ValueError(f"shared_modules group {list(group)} has no parameter name in common to tie")
    return [[f"{fqn}.{name}" for fqn in group] for name in common]


def _union(groups: list[list[str]]) -> list[list[str]]:
    out: list[list[str]] = []
    for group in groups:
        hits = [g for g in out if set(g) & set(group)]
        joined = [n for g in hits for n in g] + group
        out = [g for g in out if g not in hits] + [list(dict.fromkeys(joined))]
    return out


def check_shared_params(chunks: Sequence[nn.Module], stage_indices: Sequence[int], shared: Sequence[SharedParam]) -> None:
    """Refuse shared weights this rank cannot hold; local, so the engine runs it before any communication."""
    for sp in shared:
        here = [s for s in sp.stages if s in stage_indices]
        if len(here) > 1:
            _check_one_tensor_per_rank(sp, [chunks[list(stage_indices).index(s)] for s in here], here)


def _check_one_tensor_per_rank(sp: SharedParam, chunks: list[nn.Module], stages: list[int]) -> None:
    """Copies in several stages of one rank (V-shaped and looped schedules) work when they are one
    tensor, which autograd sums (and whose sum the copies on other ranks exchange as one), and no
    data-parallel wrapper takes part: refuse the rest."""
    why = None
    if any(isinstance(chunk, DataParallelWrapper) for chunk in chunks):
        why = "with data-parallel wrappers (each would sync it)"
    elif len({id(_find_param(chunk, sp.fqns)) for chunk in chunks}) > 1:
        why = "as separate tensors (shared_modules of an untied model)"
    if why:
        raise NotImplementedError(
            f"shared weight {list(sp.fqns)} is in two stages {stages} of this rank (a V-shaped schedule) {why}; "
            "not supported: use a looped schedule (interleaved_1f1b, zero_bubble)"
        )


def _find_param(chunk: nn.Module, fqns: Sequence[str]) -> torch.nn.Parameter:
    """The chunk's parameter under one of ``fqns``; a wrapper may prefix the names (``module.``)."""
    params = dict(chunk.named_parameters(remove_duplicate=False))
    for fqn in fqns:
        if fqn in params:
            return params[fqn]
    hits = {id(p): p for name, p in params.items() for fqn in fqns if name.endswith("." + fqn)}
    if len(hits) != 1:
        raise RuntimeError(f"cannot find the shared weight {list(fqns)} in this rank's chunk ({len(hits)} candidates)")
    return next(iter(hits.values()))


class HookGate:
    """Lets the engine re-deliver gradients through autograd without the capture hooks counting them twice."""

    paused: bool = False

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


@dataclass
class _Copy:
    shared: SharedParam
    param: torch.nn.Parameter
    chunk_index: int
    peers: list[int]
    """Global ranks of the other copies, in stage order."""
    sum: torch.Tensor | None = None
    handle: object = field(default=None, repr=False)


class TiedGradSync:
    """This rank's copies of shared weights: equal values at the start, summed grads every step."""

    def __init__(self, chunks: Sequence[nn.Module], stage_indices: Sequence[int], shared: Sequence[SharedParam],
                 rank_of_stage, group: dist.ProcessGroup, gate: HookGate) -> None:
        self.gate = gate
        self.group = group  # the PP group: the copies' ranks are in it, and point-to-point needs no new group
        self.copies: list[_Copy] = []
        for sp in shared:
            here = [s for s in sp.stages if s in stage_indices]
            ranks = sorted({rank_of_stage(s) for s in sp.stages})
            if not here or len(ranks) == 1:
                continue  # not ours, or every copy is this one tensor on this rank (autograd sums it)
            index = list(stage_indices).index(here[0])
            param = _find_param(chunks[index], sp.fqns)
            me, first = rank_of_stage(here[0]), rank_of_stage(sp.stages[0])
            copy = _Copy(sp, param, index, [r for r in ranks if r != me])
            with torch.no_grad():  # the first stage's values win, so copies start (and stay) equal
                data = local_tensor(param).data
                if me == first:
                    self._exchange([(dist.isend, data, r) for r in copy.peers])
                else:
                    received = torch.empty_like(data)
                    self._exchange([(dist.irecv, received, first)])
                    data.copy_(received)
                    # the grad norm counts the first stage's copy only, and a checkpoint keeps the
                    # optimizer state once, under the weight's one-device name (the first stage's)
                    mark_tied_replica(param, primary=sp.fqns[0])
            self.copies.append(copy)

    def _exchange(self, ops) -> None:
        works = dist.batch_isend_irecv([dist.P2POp(op, t, peer, self.group) for op, t, peer in ops])
        for work in works:
            work.wait()

    def chunk_indices(self) -> set[int]:
        """Chunks holding a shared copy: their data-parallel sync waits for :meth:`finish`."""
        return {c.chunk_index for c in self.copies}

    def begin(self) -> None:
        for copy in self.copies:
            copy.sum = None
            copy.handle = copy.param.register_hook(self._capture(copy))

    def cancel(self) -> None:
        """Drop the capture hooks of a step that failed."""
        for copy in self.copies:
            if copy.handle is not None:
                copy.handle.remove()
            copy.handle, copy.sum = None, None

    def _capture(self, copy: _Copy):
        def hook(grad: torch.Tensor) -> None:
            if self.gate.paused:
                return
            param = copy.param
            if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
                grad = grad.redistribute(param.device_mesh, param.placements)
            local = local_tensor(grad).detach()
            copy.sum = local.clone() if copy.sum is None else copy.sum.add_(local)

        return hook

    def finish(self, deliver) -> None:
        """Exchange the sums and give each copy the others' sum through ``deliver(chunk_index, params,
        grads)``, which runs one backward per chunk."""
        per_chunk: dict[int, tuple[list, list]] = {}
        for copy in self.copies:
            copy.handle.remove()
            mine = copy.sum if copy.sum is not None else torch.zeros_like(local_tensor(copy.param))
            received = [torch.empty_like(mine) for _ in copy.peers]
            mine = mine.contiguous()
            self._exchange([(dist.isend, mine, r) for r in copy.peers]
                           + [(dist.irecv, buf, r) for buf, r in zip(received, copy.peers)])
            others = received[0]
            for more in received[1:]:
                others = others + more
            param = copy.param
            if isinstance(param, DTensor):
                others = DTensor.from_local(others, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
            params, grads = per_chunk.setdefault(copy.chunk_index, ([], []))
            params.append(param)
            grads.append(others)
            copy.sum = None
        for index, (params, grads) in per_chunk.items():
            deliver(index, params, grads)
