"""A record-only trace of one forward: which torch functions ran, in which module, on which tensors.

    from ndweave.dmodule.infer.trace import meta_copy, trace

    twin = meta_copy(model)                                   # no weights copied, nothing computed
    t = trace(twin, torch.zeros(2, 8, dtype=torch.long, device="meta"))
    for op in t.ops:
        print(op.index, op.name, op.module, [t.values[v].shape for v in op.inputs])

What is recorded, at the torch-function level (a ``TorchFunctionMode``): every call of a torch
function, ``Tensor`` method or tensor property (``.T``) that returns tensors, as the model wrote it
(``F.linear``, ``view``, ``split``, ``F.scaled_dot_product_attention``, ...), with the FQN of the
innermost module running, its tensor arguments as value ids and its other arguments as plain data
(ints, slices, dtypes); every tensor as a :class:`Value` (shape, dtype, the op that made it, the
parameter or buffer it is); and each module call with the values it took and returned. Reads and
calls returning no tensor (``.shape``, ``size()``) are not recorded.

Python-level functions that dispatch as one call (``F.softmax``) are recorded as that one call;
``F.multi_head_attention_forward`` is also entered, so its inner ``linear`` / ``chunk`` / attention
ops are recorded with ``parent`` set to the outer call (``Trace.leaves()`` skips the outer ones).

It runs the model for real: trace a meta copy (:func:`meta_copy`) and the forward costs no compute
and no memory. A forward that needs a real device (``torch.autocast(x.device.type)`` fails on
"meta") runs on a fake copy instead, ``meta_copy(model, fake_mode=...)``: fake CPU tensors, with real
dtypes, shapes and device but no data. On meta and fake tensors the few data-dependent calls a model
may make (``.item()``, ``bool(t)``, ``x in t``, ``.tolist()``, ``nonzero``, a boolean mask index,
``unique``) get a stand-in answer (0, ``False``, zeros, every position, one value) and are listed in
``Trace.guesses``: shapes stay right, values and branches may not.

One trace serves several analyses: tensor-parallel plans (dataflow between linears), pipeline
cuts (module order, values crossing a boundary) and activation memory (value shapes).
"""

from __future__ import annotations

import copy
import inspect
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ndweave.mesh.torch_compat import FakeTensor, FakeTensorMode, tree_flatten

__all__ = ["ModuleCall", "Op", "Ref", "Trace", "Value", "fake_mode_of", "meta_copy", "record", "shape_only", "trace"]


@dataclass(frozen=True)
class Ref:
    """A tensor argument inside ``Op.args`` / ``ModuleCall.args``: the id of its :class:`Value`."""

    id: int


@dataclass(frozen=True)
class Value:
    """One tensor seen during the trace."""

    id: int
    """Key in ``Trace.values``; ``Ref(id)`` in arguments."""
    shape: tuple[int, ...]
    """Its shape when first seen (meta tensors have real shapes)."""
    dtype: torch.dtype
    """Its dtype when first seen."""
    producer: int | None
    """Index of the op that returned it first; ``None`` for inputs, parameters, buffers."""
    param: str | None = None
    """FQN of the parameter or buffer it is (the first name of a tied one), else ``None``."""


@dataclass(frozen=True)
class Op:
    """One recorded call."""

    index: int
    """Position in ``Trace.ops`` (calls are recorded in the order they started)."""
    name: str
    """``"F.linear"``, ``"torch.matmul"``, ``"Tensor.view"``, ... (``F.`` for ``torch.nn.functional``)."""
    module: str
    """FQN of the innermost module whose forward was running (``""``: the root)."""
    args: tuple
    """Positional arguments: tensors as :class:`Ref`, other values as plain data (see ``_plain``)."""
    kwargs: dict
    """Keyword arguments, the same way."""
    outputs: tuple[int, ...]
    """Ids of the tensors it returned, flattened (an in-place op returns its input's id)."""
    parent: int | None = None
    """Index of the enclosing recorded call (inside ``F.multi_head_attention_forward``), else ``None``."""

    @property
    def inputs(self) -> tuple[int, ...]:
        """Ids of every tensor argument, positional then keyword, in order."""
        return tuple(r.id for r in _refs((self.args, self.kwargs)))


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module's forward."""

    fqn: str
    """The module's FQN (its first name if it is registered under several)."""
    args: tuple
    """Positional arguments, as in ``Op.args``."""
    kwargs: dict
    """Keyword arguments, as in ``Op.kwargs``."""
    outputs: tuple[int, ...]
    """Ids of the tensors it returned, flattened."""
    first_op: int
    """Index of the first op recorded inside it (``== end_op`` if none)."""
    end_op: int
    """One past the last op recorded inside it."""


@dataclass
class Trace:
    """What :func:`trace` recorded."""

    ops: list[Op] = field(default_factory=list)
    values: dict[int, Value] = field(default_factory=dict)
    calls: list[ModuleCall] = field(default_factory=list)
    """Module calls in the order they returned (a child before its parent)."""
    params: dict[str, int] = field(default_factory=dict)
    """Every parameter and buffer FQN (tied aliases included) -> its value id."""
    inputs: tuple[int, ...] = ()
    """Ids of the tensors passed to the root, flattened."""
    outputs: tuple[int, ...] = ()
    """Ids of the tensors the root returned, flattened."""
    guesses: list[str] = field(default_factory=list)
    """Data-dependent calls answered with a stand-in on meta or fake tensors (see the module docstring)."""

    def leaves(self) -> list[Op]:
        """Ops with no recorded call inside them: the dataflow at its finest recorded grain."""
        parents = {op.parent for op in self.ops if op.parent is not None}
        return [op for op in self.ops if op.index not in parents]

    def consumers(self) -> dict[int, list[Op]]:
        """Value id -> the leaf ops taking it as an argument, in order."""
        out: dict[int, list[Op]] = {}
        for op in self.leaves():
            for vid in dict.fromkeys(op.inputs):
                out.setdefault(vid, []).append(op)
        return out

    def aliases(self) -> dict[int, list[str]]:
        """Value id of each parameter / buffer -> every FQN it goes by (tied weights have several)."""
        out: dict[int, list[str]] = {}
        for fqn, vid in self.params.items():
            out.setdefault(vid, []).append(fqn)
        return out


def meta_copy(model: nn.Module, fake_mode: FakeTensorMode | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes and dtypes
    (tied ones still tied): a deep copy of the module tree that copies no weights. Works on real,
    meta and fake (``deferred_init``) models. With ``fake_mode``, they are fake CPU tensors of that
    mode instead (see :func:`shape_only`)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(shape_only(p.shape, p.dtype, fake_mode), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = shape_only(b.shape, b.dtype, fake_mode)
    return copy.deepcopy(model, memo)


def shape_only(shape: tuple[int, ...], dtype: torch.dtype, fake_mode: FakeTensorMode | None = None) -> torch.Tensor:
    """An empty tensor holding no data: on meta, or with ``fake_mode`` a fake CPU tensor of it. A fake
    tensor says its device is "cpu", so a forward may use its device (``torch.autocast(x.device.type)``
    raises "unsupported scalarType" for "meta"); the mode should allow non-fake inputs, as the tensors
    a forward makes itself (``torch.arange(T)``) are real."""
    if fake_mode is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    with fake_mode:
        return torch.empty(shape, dtype=dtype, device="cpu")


def fake_mode_of(model: nn.Module) -> FakeTensorMode | None:
    """The fake mode of ``model``'s first fake parameter or buffer, else ``None``."""
    for t in (*model.parameters(), *model.buffers()):
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


def trace(model: nn.Module, *args: Any, **kwargs: Any) -> Trace:
    """Run ``model(*args, **kwargs)`` once and record it (see the module docstring). Hooks are put on
    every submodule for the call and removed after, even when the forward raises."""
    out = Trace()
    record(out, model, args, kwargs)
    return out


def record(into: Trace, model: nn.Module, args: tuple = (), kwargs: dict | None = None) -> Any:
    """:func:`trace` into ``into`` (empty), returning the model's output. When the forward raises,
    ``into`` holds what ran until then: its last op is the call that raised."""
    recorder = _Recorder(model, into)
    with ExitStack() as stack:
        for handle in recorder.hooks():
            stack.callback(handle.remove)
        result = recorder.run(model, args, kwargs or {})
    into.outputs = tuple(recorder.ids(result))
    return result


# Python-level torch functions that dispatch as one call but whose inner calls are worth recording:
# torch's own attention runs its projections inside, with no nn.Linear in sight.
_ENTERED: tuple[Callable, ...] = (F.multi_head_attention_forward,)


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module, into: Trace):
        super().__init__()
        self.trace = into
        self._tensors: dict[int, torch.Tensor] = {}  # id(tensor) -> tensor, kept alive so ids stay unique
        self._vid: dict[int, int] = {}               # id(tensor) -> value id
        self._modules = _first_names(model)
        self._stack: list[tuple[str, int, tuple, dict]] = []  # running modules: (fqn, first op, args, kwargs)
        self._parents: list[int] = []
        for fqn, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
            self.trace.params[fqn] = self._value(t, None, param=fqn)

    # ------------------------------------------------------------------------------ module calls
    def hooks(self) -> list[Any]:
        handles = []
        for module, fqn in self._modules.items():
            handles.append(module.register_forward_pre_hook(self._enter(fqn), with_kwargs=True))
            handles.append(module.register_forward_hook(self._exit(fqn), with_kwargs=True, always_call=True))
        return handles

    def _enter(self, fqn: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._stack.append((fqn, len(self.trace.ops), self._plain(args), self._plain(kwargs)))
        return hook

    def _exit(self, fqn: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            name, first, plain_args, plain_kwargs = self._stack.pop()
            self.trace.calls.append(ModuleCall(name, plain_args, plain_kwargs, tuple(self.ids(output)), first,
                                               len(self.trace.ops)))
        return hook

    def run(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        self.trace.inputs = tuple(self.ids((args, kwargs)))
        with self:
            return model(*args, **kwargs)

    # ------------------------------------------------------------------------------- torch calls
    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name.endswith("__get__"):  # a property: only tensor-valued ones (.T, .mT) are dataflow
            result = func(*args, **kwargs)
            if not isinstance(result, torch.Tensor):
                return result
            name = f"Tensor.{getattr(getattr(func, '__self__', None), '__name__', 'property')}"
            index = len(self.trace.ops)
            self.trace.ops.append(Op(index, name, self._module(), self._plain(args), {},
                                     tuple(self.ids(result, producer=index)),
                                     self._parents[-1] if self._parents else None))
            return result
        guess = self._guess(name, args)
        if guess is not _NO_GUESS:
            return guess
        index = len(self.trace.ops)
        parent = self._parents[-1] if self._parents else None
        plain_args, plain_kwargs = self._plain(args), self._plain(kwargs)
        self.trace.ops.append(Op(index, name, self._module(), plain_args, plain_kwargs, (), parent))
        if func in _ENTERED:
            result = self._enter_python(func, index, args, kwargs)
        else:
            result = func(*self._meta_indices(name, args), **kwargs)
        outputs = tuple(self.ids(result, producer=index))
        if name == "Tensor.__setitem__" and args and isinstance(args[0], torch.Tensor):
            outputs = tuple(self.ids(args[0]))  # (in place, returning None: its target is what flows on)
        if not outputs:  # size(), dim(), ...: nothing flows on from it
            if self.trace.ops[-1].index == index:
                self.trace.ops.pop()
            return result
        self.trace.ops[index] = Op(index, name, self.trace.ops[index].module, plain_args, plain_kwargs, outputs, parent)
        return result

    def _enter_python(self, func: Callable, index: int, args: tuple, kwargs: dict) -> Any:
        """Run a Python-level torch function with this mode active inside it. Its own
        ``has_torch_function`` check would hand the call straight back to the mode, so that one name
        in ``torch.nn.functional`` answers ``False`` for the call (restored after, even on error)."""
        module = inspect.getmodule(func)
        saved = module.has_torch_function
        module.has_torch_function = lambda *_: False
        self._parents.append(index)
        try:
            with self:
                return func(*args, **kwargs)
        finally:
            self._parents.pop()
            module.has_torch_function = saved

    def _guess(self, name: str, args: tuple) -> Any:
        """A stand-in answer for a data-dependent call on a meta or fake tensor, or ``_NO_GUESS``."""
        base = name.rsplit(".", 1)[-1]
        if base not in _DATA_DEPENDENT or not args or not _holds_no_data(args[0]):
            return _NO_GUESS
        t = args[0]
        if base == "where" and len(args) > 1:  # torch.where(cond, a, b) is elementwise
            return _NO_GUESS
        self.trace.guesses.append(f"{name} in {self._module() or '<root>'}")
        if base == "item":
            return 0.0 if t.is_floating_point() else 0
        if base in ("__bool__", "__contains__"):  # (``pad_id in ids``: transformers' padding warning)
            return False
        if base == "tolist":
            return torch.zeros(t.shape, dtype=torch.long).tolist()
        if base == "where":  # torch.where(cond): nonzero as a tuple
            return tuple(t.new_empty(t.numel(), dtype=torch.long) for _ in range(t.dim()))
        if base in ("unique", "unique_consecutive"):  # every value the same: one (a check that they agree passes)
            return t.reshape(-1)[:1]
        return t.new_empty((t.numel(), t.dim()), dtype=torch.long)  # nonzero

    def _meta_indices(self, name: str, args: tuple) -> tuple:
        """``t[i]`` with ``i`` a 0-dim integer meta or fake tensor (an index taken from such a tensor)
        reads ``i``'s value inside torch: index with 0 instead, recorded as a guess."""
        if name not in ("Tensor.__getitem__", "Tensor.__setitem__") or len(args) < 2:
            return args
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        scalar = [_holds_no_data(i) and i.dim() == 0 and not i.is_floating_point()
                  and i.dtype != torch.bool for i in index]
        # a boolean mask (``hidden[eos_mask, :]``): every position taken, as the nonzero guess does; a
        # real all-True mask, whose count torch reads, indexes a meta or fake tensor
        mask = [_holds_no_data(i) and i.dim() > 0 and i.dtype == torch.bool for i in index]
        if not any(scalar) and not any(mask):
            return args
        self.trace.guesses.append(f"{name} with a meta index in {self._module() or '<root>'}")
        index = tuple(0 if s else torch.ones(i.shape, dtype=torch.bool) if m else i
                      for s, m, i in zip(scalar, mask, index))
        return (args[0], index if isinstance(args[1], tuple) else index[0], *args[2:])

    # ------------------------------------------------------------------------------------ values
    def _module(self) -> str:
        return self._stack[-1][0] if self._stack else ""

    def _value(self, t: torch.Tensor, producer: int | None, param: str | None = None) -> int:
        key = id(t)
        if key in self._vid:
            return self._vid[key]
        vid = len(self.trace.values)
        self._tensors[key] = t
        self._vid[key] = vid
        self.trace.values[vid] = Value(vid, tuple(t.shape), t.dtype, producer, param)
        return vid

    def ids(self, obj: Any, producer: int | None = None) -> list[int]:
        leaves, _ = tree_flatten(obj)
        return [self._value(x, producer) for x in _tensors_in(leaves)]

    def _plain(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return Ref(self._value(obj, None))
        if isinstance(obj, torch.Size):
            return tuple(obj)
        if obj is None or obj is Ellipsis or isinstance(obj, (bool, int, float, str, torch.dtype)):
            return obj
        if isinstance(obj, slice):
            return slice(self._plain(obj.start), self._plain(obj.stop), self._plain(obj.step))
        if isinstance(obj, (list, tuple)):
            plain = [self._plain(x) for x in obj]
            return plain if type(obj) is list else tuple(plain)  # (a namedtuple becomes a tuple)
        if isinstance(obj, dict):
            return {k: self._plain(v) for k, v in obj.items()}
        if isinstance(obj, torch.device):
            return str(obj)
        leaves, _ = tree_flatten(obj)  # a dataclass / ModelOutput / cache: keep only the tensors in it
        refs = tuple(Ref(self._value(x, None)) for x in _tensors_in(leaves))
        return refs if refs else f"<{type(obj).__name__}>"


_NO_GUESS = object()
_FUNCTIONAL = (F.__name__, F.linear.__module__)  # F.* written in Python, and those torch binds from C
_DATA_DEPENDENT = {"item", "__bool__", "__contains__", "tolist", "nonzero", "where", "unique", "unique_consecutive"}


def _holds_no_data(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_meta or isinstance(t, FakeTensor))


def _tensors_in(leaves: list) -> list[torch.Tensor]:
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _refs(obj: Any) -> list[Ref]:
    if isinstance(obj, Ref):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [r for x in obj for r in _refs(x)]
    if isinstance(obj, dict):
        return [r for x in obj.values() for r in _refs(x)]
    if isinstance(obj, slice):
        return _refs((obj.start, obj.stop, obj.step))
    return []


def _first_names(model: nn.Module) -> dict[nn.Module, str]:
    names: dict[nn.Module, str] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        names.setdefault(module, fqn)
    return names


def _name(func: Callable) -> str:
    """``"F.linear"``, ``"torch.matmul"``, ``"Tensor.view"``: where the function lives, shortened."""
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if "<locals>" in qualname:  # (torch.unique_consecutive is boolean_dispatch's local ``fn``, named after it)
        qualname = getattr(func, "__name__", qualname)
    owner, _, base = qualname.rpartition(".")
    if owner in ("TensorBase", "Tensor"):
        return f"Tensor.{base}"
    if owner == "_VariableFunctionsClass":
        return f"torch.{base}"
    module = getattr(func, "__module__", None) or ""
    if module in _FUNCTIONAL:
        return f"F.{base}"
    if module == "torch":
        return f"torch.{base}"
    return f"{module}.{qualname}" if module else qualname
