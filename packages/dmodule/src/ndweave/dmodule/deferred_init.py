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

from ndweave.mesh.torch_compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    op_schema,
    storage_id,
    tree_flatten,
    tree_map,
)

__all__ = ["deferred_init", "is_deferred", "replay", "storage_key", "take_program", "DeferredProgram", "MaterializeStats"]

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
    overwrites: int | None = None
    """Storage key this op overwrites entirely without reading it (``normal_`` on a whole parameter):
    the values before it are dead, so the storage can be freed in between."""


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

    def __deepcopy__(self, memo: dict) -> DeferredProgram:
        # Copies of a deferred module (the auto plan's meta copies) share the program: replay only
        # reads it. Deep-copying the fake tensors it holds, outside their FakeTensorMode, corrupted the
        # heap in torch 2.13: a crash in a later collection, about one in 12 auto plans of a deferred
        # GPT-2 followed by a materialization (CI, and reproduced here).
        return self


#: In-place ops that write every element without reading any (schema-less recorded calls, i.e. the
#: data-dependent nn.init functions, overwrite too).
_OVERWRITING_OPS = frozenset({
    "uniform_", "normal_", "fill_", "zero_", "bernoulli_", "random_", "exponential_", "geometric_",
    "log_normal_", "cauchy_",
})


def _covers_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views share it), as recorded ops and ``replay`` targets key it."""
    return storage_id(t)


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
        schema = op_schema(func)
        random = schema is None or any(a.name == "generator" for a in schema.arguments)
        name = getattr(func, "__name__", "")
        overwrites = None
        if ins and isinstance(ins[0], FakeTensor) and _covers_storage(ins[0]) and (
            schema is None or name.split(".")[0] in _OVERWRITING_OPS
        ):
            overwrites = storage_key(ins[0])
        self.program.ops.append(_Op(
            func, args, kwargs, out,
            in_keys=[storage_key(t) for t in ins if isinstance(t, FakeTensor)],
            out_keys=[storage_key(t) for t in outs],
            lazy=not ins and not random,
            overwrites=overwrites,
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
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), recorder, _recorded_data_dependent_inits(recorder):
            module = module_fn(*args, **kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        raise RuntimeError(
            f"deferred_init({getattr(module_fn, '__name__', module_fn)}): construction reads tensor values "
            f"({err}), which fake tensors do not have. torch.nn.init.{{{', '.join(_DATA_DEPENDENT_INITS)}}} "
            "are handled when called through torch.nn.init; otherwise build the module eagerly."
        ) from err
    if not isinstance(module, nn.Module):
        raise TypeError(f"deferred_init: module_fn returned a {type(module).__name__}, not an nn.Module")
    module.__dict__[_ATTR] = program
    return module


def is_deferred(module: nn.Module) -> bool:
    return _ATTR in module.__dict__


def take_program(module: nn.Module) -> DeferredProgram:
    return module.__dict__.pop(_ATTR)


def replay(program: DeferredProgram, targets: dict[int, list[Callable[[torch.Tensor], int]]]) -> MaterializeStats:
    """Replay ``program`` on CPU; when a storage in ``targets`` holds its final values, call its
    callbacks with the real tensor that created that storage (each keeps what it needs, e.g. a local
    shard, and returns the bytes it kept), then free it.

    A storage lives in *generations*: each op that overwrites it entirely starts a new one. Between
    the last op of one generation and the overwrite that starts the next, the storage is freed
    ("dormant"): an ``nn.Linear`` reset at construction and re-initialized by a model-wide
    ``_init_weights`` at the end holds no memory in between, yet its RNG draws still happen in order.
    """
    ops = program.ops
    fakes: dict[int, FakeTensor] = {}  # id -> fake tensor seen in the program
    key_of: dict[int, int] = {}  # id(fake) -> storage key
    creator: dict[int, tuple[int, int]] = {}  # storage key -> (op index, output position)
    generation: dict[int, int] = defaultdict(int)
    ends: dict[int, list[tuple[int, int]]] = defaultdict(list)  # op index -> (key, generation) ending there
    last: dict[tuple[int, int], int] = {}
    for i, op in enumerate(ops):
        ins = [t for t in _tensors((op.args, op.kwargs)) if isinstance(t, FakeTensor)]
        for t, k in [*zip(ins, op.in_keys), *zip(_tensors(op.out), op.out_keys)]:
            fakes.setdefault(id(t), t)
            key_of.setdefault(id(t), k)
        for j, k in enumerate(op.out_keys):
            creator.setdefault(k, (i, j))
        if op.overwrites is not None and op.overwrites in generation:
            generation[op.overwrites] += 1
        for k in op.in_keys + op.out_keys:
            generation.setdefault(k, 0)
            last[(k, generation[k])] = i
    for (k, g), i in last.items():
        ends[i].append((k, g))
    final_generation = dict(generation)
    missing = set(targets) - set(creator)
    if missing:
        raise RuntimeError(f"deferred_init: {len(missing)} parameter(s) were not created by recorded ops")
    members: dict[int, set[int]] = defaultdict(set)  # storage key -> ids of fakes of it
    for fid, k in key_of.items():
        members[k].add(fid)

    env: dict[int, torch.Tensor] = {}  # id(fake) -> real tensor
    live: dict[int, int] = {}  # storage key -> bytes of its real storage
    ran: set[int] = set()
    done: set[int] = set()
    stats = MaterializeStats()

    def note_peak() -> None:
        stats.peak_bytes = max(stats.peak_bytes, sum(live.values()) + stats.local_bytes)

    def real(x: Any) -> Any:
        if not isinstance(x, FakeTensor):
            return x
        if id(x) not in env:
            k = key_of[id(x)]
            i, _ = creator[k]
            if i not in ran:
                run(i)
            else:  # dormant: a fresh storage, every known view of it re-created over it
                root = _tensors(ops[i].out)[creator[k][1]]
                flat = torch.empty(root.untyped_storage().nbytes() // root.element_size(), dtype=root.dtype)
                for fid in members[k]:
                    f = fakes[fid]
                    env[fid] = flat.as_strided(f.size(), f.stride(), f.storage_offset())
                live[k] = flat.untyped_storage().nbytes()
                note_peak()
        return env[id(x)]

    def run(i: int) -> None:
        if i in ran:
            return
        ran.add(i)
        op = ops[i]
        args, kwargs = tree_map(real, (op.args, op.kwargs))
        out = op.func(*args, **kwargs)
        for f, r in zip(tree_flatten(op.out)[0], tree_flatten(out)[0]):
            if isinstance(f, FakeTensor) and id(f) not in env:
                env[id(f)] = r
                live.setdefault(key_of[id(f)], r.untyped_storage().nbytes())
        note_peak()

    def release(k: int) -> None:
        for fid in members[k]:
            env.pop(fid, None)
        live.pop(k, None)

    def finalize(k: int) -> None:
        if k in done:
            return
        done.add(k)
        if k in targets:
            i, j = creator[k]
            run(i)
            full = real(_tensors(ops[i].out)[j])
            stats.largest_full_param_bytes = max(stats.largest_full_param_bytes, full.untyped_storage().nbytes())
            for keep in targets[k]:
                stats.local_bytes += keep(full)
            note_peak()
        release(k)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.set_rng_state(program.rng_state)
        for i, op in enumerate(ops):
            if not op.lazy:
                run(i)
            for k, g in ends.get(i, ()):
                if g == final_generation[k]:
                    finalize(k)
                else:
                    release(k)
        for k in targets:
            finalize(k)
    return stats
