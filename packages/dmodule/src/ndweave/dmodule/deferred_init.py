"""``deferred_init``: build a module without memory, then materialize only this rank's shards, with
values bit-equal to eager initialization under the same seed.

How: ``module_fn`` runs under ``FakeTensorMode`` (no storage; ``torch.nn.init`` still runs, unlike
on ``meta`` where it returns early) with a dispatch mode on top that records every op it performs,
in order. ``parallelize_module`` later replays that program on real CPU tensors, starting from the
CPU RNG state ``deferred_init`` saw, so random ops draw exactly the numbers eager init drew
(DTensor's own random ops are not layout-consistent on CPU; replaying on full tensors sidesteps
that). Memory stays bounded because the replay

- runs non-random creation ops (``empty``, ``zeros``) only when a later op first needs the tensor,
- and, after the last op touching a parameter's storage, keeps the local shard and frees the rest,

so at most one full parameter is alive at a time for the usual "create, then init each" pattern.

Initializers with data-dependent control flow (``trunc_normal_``'s rejection loop, ``orthogonal_``,
``sparse_``) cannot run on fake tensors; while ``module_fn`` runs they are recorded as single calls
and replayed as such.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["deferred_init", "is_deferred", "DeferredProgram", "MaterializeStats"]

_ATTR = "_ndweave_deferred"
_DATA_DEPENDENT_INITS = ("trunc_normal_", "orthogonal_", "sparse_")


@dataclass
class _Op:
    func: Callable
    args: tuple
    kwargs: dict
    out: Any
    in_keys: list[int]
    """Storage keys of the tensor inputs (at record time)."""
    out_keys: list[int]
    lazy: bool
    """A creation op with no tensor inputs and no randomness: run when first needed."""


@dataclass
class MaterializeStats:
    """Bytes accounted by the replay (live full storages + kept local shards)."""

    peak_bytes: int = 0
    local_bytes: int = 0
    largest_full_param_bytes: int = 0

    def __str__(self) -> str:
        return (f"peak {self.peak_bytes} B (local shards {self.local_bytes} B + largest full param "
                f"{self.largest_full_param_bytes} B = bound {self.local_bytes + self.largest_full_param_bytes} B)")


@dataclass
class DeferredProgram:
    """The recorded construction of a deferred module."""

    ops: list[_Op] = field(default_factory=list)
    rng_state: torch.Tensor | None = None


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    def __init__(self, program: DeferredProgram) -> None:
        super().__init__()
        self.program = program

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        outs = _tensors(out)
        if not outs:
            return  # metadata queries (prim.device, sizes): nothing to replay
        ins = _tensors((args, kwargs))
        schema = getattr(func, "_schema", None)
        random = schema is None or any(a.name == "generator" for a in schema.arguments)
        self.program.ops.append(_Op(
            func, args, kwargs, out,
            in_keys=[_key(t) for t in ins if isinstance(t, FakeTensor)],
            out_keys=[_key(t) for t in outs],
            lazy=not ins and not random,
        ))


@contextlib.contextmanager
def _recorded_data_dependent_inits(recorder: _Recorder) -> Iterator[None]:
    originals = {name: getattr(nn.init, name) for name in _DATA_DEPENDENT_INITS}

    def wrap(fn: Callable) -> Callable:
        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not isinstance(tensor, FakeTensor):
                return fn(tensor, *args, **kwargs)
            recorder.record(fn, (tensor, *args), kwargs, tensor)
            return tensor

        return recorded

    try:
        for name, fn in originals.items():
            setattr(nn.init, name, wrap(fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


def deferred_init(module_fn: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """Build ``module_fn(*args, **kwargs)`` without allocating its parameters.

    Pass the result to ``parallelize_module``: it allocates only this rank's shards, with values
    bit-equal to ``torch.manual_seed(s); module_fn(*args, **kwargs)`` when the seed was ``s`` at the
    time of this call. The global RNG is left where it was (the replay uses a copy of its state)::

        torch.manual_seed(0)
        mlp = deferred_init(MLP)
        dmlp = parallelize_module(mlp, mesh, plan)
    """
    program = DeferredProgram(rng_state=torch.get_rng_state())
    recorder = _Recorder(program)
    with FakeTensorMode(allow_non_fake_inputs=True), recorder, _recorded_data_dependent_inits(recorder):
        module = module_fn(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise TypeError(f"deferred_init: module_fn returned a {type(module).__name__}, not an nn.Module")
    module.__dict__[_ATTR] = program
    return module


def is_deferred(module: nn.Module) -> bool:
    return _ATTR in module.__dict__


def take_program(module: nn.Module) -> DeferredProgram:
    return module.__dict__.pop(_ATTR)


def replay(program: DeferredProgram, targets: dict[int, Callable[[torch.Tensor], int]]) -> MaterializeStats:
    """Replay ``program`` on CPU; when a storage in ``targets`` is final, call its callback with the
    real storage's root tensor (the callback keeps what it needs and returns the bytes it kept)."""
    ops = program.ops
    last_use: dict[int, int] = {}
    creator: dict[int, tuple[int, int]] = {}  # storage key -> (op index, output position)
    for i, op in enumerate(ops):
        for k in op.in_keys + op.out_keys:
            last_use[k] = i
        for j, k in enumerate(op.out_keys):
            creator.setdefault(k, (i, j))
    missing = set(targets) - set(creator)
    if missing:
        raise RuntimeError(f"deferred_init: {len(missing)} parameter(s) were not created by recorded ops")
    finals: dict[int, list[int]] = defaultdict(list)
    for k, i in last_use.items():
        finals[i].append(k)

    env: dict[int, torch.Tensor] = {}  # id(fake) -> real
    members: dict[int, list[int]] = defaultdict(list)  # storage key -> ids in env
    live: dict[int, int] = {}  # storage key -> bytes of its real storage
    stats = MaterializeStats()
    done: set[int] = set()

    def real(x: Any) -> Any:
        if isinstance(x, FakeTensor):
            if id(x) not in env:
                run(creator[_key_of_fake[id(x)]][0])
            return env[id(x)]
        return x

    _key_of_fake: dict[int, int] = {}
    for op in ops:
        for t, k in zip([t for t in _tensors((op.args, op.kwargs)) if isinstance(t, FakeTensor)], op.in_keys):
            _key_of_fake.setdefault(id(t), k)
        for t, k in zip(_tensors(op.out), op.out_keys):
            _key_of_fake.setdefault(id(t), k)

    ran: set[int] = set()

    def run(i: int) -> None:
        if i in ran:
            return
        ran.add(i)
        op = ops[i]
        args, kwargs = tree_map(real, (op.args, op.kwargs))
        out = op.func(*args, **kwargs)
        fakes, _ = tree_flatten(op.out)
        reals, _ = tree_flatten(out)
        for f, r in zip(fakes, reals):
            if isinstance(f, torch.Tensor) and id(f) not in env:
                env[id(f)] = r
                k = _key_of_fake[id(f)]
                members[k].append(id(f))
                if k not in live:
                    live[k] = r.untyped_storage().nbytes()
        stats.peak_bytes = max(stats.peak_bytes, sum(live.values()) + stats.local_bytes)

    def finalize(k: int) -> None:
        if k in done:
            return
        done.add(k)
        if k in targets:
            i, j = creator[k]
            run(i)
            root = _tensors(ops[i].out)[j]
            full = env[id(root)]
            stats.largest_full_param_bytes = max(stats.largest_full_param_bytes, full.untyped_storage().nbytes())
            stats.local_bytes += targets[k](full)
            stats.peak_bytes = max(stats.peak_bytes, sum(live.values()) + stats.local_bytes)
        for tid in members.pop(k, []):
            env.pop(tid, None)
        live.pop(k, None)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.set_rng_state(program.rng_state)
        for i, op in enumerate(ops):
            if not op.lazy:
                run(i)
            for k in finals.get(i, ()):
                finalize(k)
        for k in targets:
            finalize(k)
    return stats
