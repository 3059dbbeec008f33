"""The root ``forward`` as a graph: one trace on ``meta`` tensors, with the layers as opaque calls.

``torch.fx`` records every op the root ``forward`` (and each module it steps into: the root, and the
modules holding the layer containers) performs between layers, and each layer call as one
``call_module`` node, so the layers stay the user's own modules (hooks, tensor parallelism, their
FQNs) and the work between them (an add, a norm, position ids, a mask) becomes nodes a stage can
own. Unlike plain symbolic tracing, every node also carries its value, computed on ``meta`` tensors
as it is recorded (a layer runs through ``torch.func.functional_call`` with its tensors swapped for
``meta`` ones, so nothing is computed or allocated). So Python control flow on a traced value works:
an ``assert T <= block_size``, a branch on ``x.dim()``, HF's mask building are answered with the
example's values and specialized to them, and the shapes the ops compute stay symbolic. (``torch.export``
would also trace the layers' insides, fixing their ``view(B, T, -1, head)`` to the example's head
count, and hand back graph modules instead of the user's layers.)
"""

from __future__ import annotations

import builtins
import functools
import inspect
import os
import traceback
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.proxy import Attribute, Proxy

from ndweave.mesh.torch_compat import FakeTensorMode
from ndweave.pipeline.inputs import split_inputs

__all__ = ["ForwardGraph", "input_name", "trace_forward"]

# torch's argument parser takes ``torch.ones(T, T)`` only with int sizes, not proxies (fx alone fails
# there too); during a trace these record a node when a size is traced
_FACTORIES = ("empty", "eye", "full", "ones", "rand", "randn", "zeros")
_CALLABLE = builtins.callable


@functools.cache
def _recorded_functions() -> tuple[str, ...]:
    """The factories, and every ``torch.*`` function torch's C++ argument parser reads: it takes a
    traced tensor (which passes ``isinstance(x, Tensor)``, see ``_ValueProxy.__class__``) for a real
    one where an overload wants a number, and crashes the process (``torch.pow(x, 2)``,
    ``torch.where(mask, x, -inf)``). So these record their node before torch parses anything."""
    # (torch's public lists of its functions; the C++-parsed ones are builtins: factories such as
    # arange are in the ignored list, taking no tensor)
    listed = [*torch.overrides.get_overridable_functions().get(torch, ()), *torch.overrides.get_ignored_functions()]
    parsed = [f for f in listed if isinstance(f, types.BuiltinFunctionType) and getattr(torch, f.__name__, None) is f]
    return tuple(sorted({f.__name__ for f in parsed if not f.__name__.startswith("_")} | set(_FACTORIES)))


def _is_torch_machinery(filename: str) -> bool:
    """A frame of torch's tracing and dispatch (fx, dynamo, its private modules), not of a model:
    what fx's own filter leaves out (``torch.nn``'s modules, a model's code, stay)."""
    root = os.path.dirname(torch.__file__) + os.sep
    if not filename.startswith(root):
        return filename == "<string>"
    inside = filename[len(root):]
    return inside.startswith(("_", "fx" + os.sep, "export" + os.sep)) or inside == "__init__.py"


@dataclass
class ForwardGraph:
    """The traced root ``forward``: its graph, each node's example value, and the tensors it created."""

    graph: fx.Graph
    """Placeholders (the model's inputs: the positional ones, then the keyword tensors, each named by
    the forward's parameter), ops, one ``call_module`` node per layer call, output."""
    values: dict[fx.Node, Any]
    """Each node's value on the example (``meta`` tensors, ints, tuples of them, ...)."""
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors the forward created without inputs (``torch.ones(3)``), by the ``get_attr`` target naming them."""
    inputs: tuple = ()
    """The example's values of the placeholders, in their order (as given: real or ``meta``)."""
    positional: tuple[str, ...] = ()
    """The forward's positional parameter names (to bind a batch's positional inputs by)."""

    @property
    def nodes(self) -> list[fx.Node]:
        return list(self.graph.nodes)


def trace_forward(model: nn.Module, example_inputs: Any, layers: Sequence[str]) -> ForwardGraph:
    """Trace ``model(*args, **kwargs)`` with the modules named in ``layers`` as opaque calls.

    ``example_inputs``: a tensor, a tuple (positional) or a dict (keyword arguments, bound to the
    forward's signature; parameters left out keep their defaults, and a value that is no tensor, e.g.
    ``use_cache=False``, is passed as it is and fixed in the graph). Tensors may be real or ``meta``
    (only their shapes and dtypes are used); the model may live on any device, ``meta`` included, and
    is left as it was."""
    args, kwargs = split_inputs(example_inputs)
    failures = []
    for fake in (False, True):
        tracer = _ValueTracer(set(layers), args, kwargs, FakeTensorMode(allow_non_fake_inputs=True) if fake
                              else None)
        try:
            graph = tracer.trace(model)
            break
        except Exception as error:  # noqa: BLE001 (the model's own code failing is the answer)
            failures.append(f"{'on fake tensors' if fake else 'on meta'}: {error}")
            cause = error
    else:
        # fx takes tensors, numbers and containers of them as a layer's arguments, not an object the
        # forward made to hand its layers (HF's DynamicCache): the fix is the input that turns it off
        hint = ("; a layer is handed an object that is no tensor (a cache?): pass example_inputs as a dict with "
                "the keyword that turns it off (HF models: use_cache=False)"
                if isinstance(cause, NotImplementedError) and "argument of type" in str(cause) else "")
        raise type(cause)(f"tracing {type(model).__name__}.forward for the pipeline failed: "
                          f"{'; '.join(failures)}{hint}") from cause
    _drop_dead_code(graph)
    return ForwardGraph(graph, tracer.values, tracer.constants, tracer.inputs, tracer.positional)


def _to_meta(value: Any, fake_mode: FakeTensorMode | None = None) -> Any:
    """A tensor's stand-in for the trace: on ``meta``, or with ``fake_mode`` a fake tensor on the CPU
    (the fallback for forwards that use their tensors' device: ``torch.autocast(x.device.type)`` fails
    on "meta")."""
    if isinstance(value, torch.Tensor):
        # requires_grad kept: what the forward does with it (``x.retain_grad()``) is answered as for real
        if fake_mode is None:
            return torch.empty(value.shape, dtype=value.dtype, device="meta", requires_grad=value.requires_grad)
        with fake_mode:
            return torch.empty(value.shape, dtype=value.dtype, device="cpu", requires_grad=value.requires_grad)
    return value


class _ValueProxy(Proxy):
    """A proxy that answers what Python needs concretely (``len``, ``int``, ``range``) from its value."""

    _is_param = False  # (read by ``isinstance(x, nn.Parameter)``; found here, it traces nothing)

    def __len__(self) -> int:
        return len(self.tracer.value(self))

    def __int__(self) -> int:
        return int(self.tracer.value(self))

    def __index__(self) -> int:
        return int(self.tracer.value(self))

    def __getattr__(self, name: str) -> Any:
        attribute = _ValueAttribute(self, name)
        if name != "dtype":  # (lazy: fx asks proxies for attributes of its own, which must make no node)
            return attribute
        # a dtype is the example's, fixed by the model's weights: the value itself, which torch's own
        # functions take where they take no proxy (HF's masks: ``torch.finfo(embeds.dtype).min``)
        value = self.tracer.values.get(attribute.node)
        return value if isinstance(value, torch.dtype) else attribute

    @property
    def __class__(self) -> type:
        """A traced tensor passes the forward's ``isinstance(x, torch.Tensor)`` (torch's own
        ``TransformerEncoder`` checks its mask so); ``type(x)`` and fx's checks still see a proxy."""
        state = vars(self)  # (not ``self.node``: an attribute's is made when first read, by a trace)
        node, tracer = state.get("node", state.get("_node")), state.get("tracer")
        value = tracer.values.get(node) if node is not None and tracer is not None else None
        return type(value) if isinstance(value, torch.Tensor) else type(self)


class _ValueAttribute(Attribute, _ValueProxy):
    """``x.shape``, ``x.device``, ...: fx's lazy attribute, with the same concrete answers."""


class _ValueTracer(fx.Tracer):
    def __init__(self, layers: set[str], args: tuple, kwargs: dict[str, Any],
                 fake_mode: FakeTensorMode | None = None) -> None:
        super().__init__(autowrap_functions=())
        self.layers = layers
        self.args, self.kwargs = args, kwargs
        self.inputs: tuple = ()
        self.positional: tuple[str, ...] = ()
        self.fake_mode = fake_mode
        self.values: dict[fx.Node, Any] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self._computing = False  # running a value: module calls and attributes are the real ones

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        # each node records the user's frames, so errors can point at the user's line: from the first
        # forward on, torch's left out (fx's own ``record_stack_traces`` filter imports torch._dynamo,
        # torch.export and inductor to list their files: 0.4 s, once per process)
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not node.stack_trace:
            stack = traceback.extract_stack()
            forward = next((i for i, frame in enumerate(stack) if frame.name == "forward"), None)
            frames = [] if forward is None else [f for f in stack[forward:] if not _is_torch_machinery(f.filename)]
            if frames:
                node.stack_trace = "".join(traceback.StackSummary.from_list(frames).format()).strip()
        return node

    def trace(self, root, concrete_args=None):
        # torch caches the overridable functions it finds in ``torch``'s namespace the first time fx's
        # proxies ask (``torch.overrides.get_overridable_functions``, for the process's life): asked
        # while the functions below are patched, it would keep the patches, and through them this
        # tracer and the model it traced; asked before, it keeps torch's own
        torch.overrides.get_overridable_functions()
        originals = {name: getattr(torch, name) for name in _recorded_functions()}
        for name, factory in originals.items():
            setattr(torch, name, self._recording(factory))
        # ``callable(x)`` of a traced value answers for the value: every fx proxy is callable, and a
        # forward's ``default(x, fallback)`` (x-transformers: ``arg() if callable(arg) else arg``)
        # would call a tensor
        builtins.callable = self._callable
        try:
            return super().trace(root, concrete_args)
        finally:
            builtins.callable = _CALLABLE
            for name, factory in originals.items():
                setattr(torch, name, factory)

    def _callable(self, obj: Any) -> bool:
        return _CALLABLE(self.value(obj) if isinstance(obj, _ValueProxy) and obj.node in self.values else obj)

    def _recording(self, factory):
        @functools.wraps(factory)
        def recording(*args, **kwargs):
            traced = []
            fx.node.map_aggregate((args, kwargs), lambda a: traced.append(a) if isinstance(a, Proxy) else None)
            if traced and not self._computing:
                return self.create_proxy("call_function", factory, args, kwargs)
            return factory(*args, **kwargs)

        return recording

    # ------------------------------------------------------------------ what is opaque
    def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
        return qualname in self.layers

    def call_module(self, module, forward, args, kwargs):
        if self._computing:
            return forward(*args, **kwargs)
        try:
            self.path_of_module(module)
        except NameError:  # made by the forward as it runs (litgpt's ``nn.Identity()`` head clamp): inlined
            return forward(*args, **kwargs)
        return super().call_module(module, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    # ------------------------------------------------------------------ values
    def proxy(self, node: fx.Node) -> _ValueProxy:
        return _ValueProxy(node, self)

    def value(self, proxy: Proxy) -> Any:
        return self.values[proxy.node]

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind != "placeholder":
            self._computing = True
            try:
                self.values[proxy.node] = self._compute(kind, target, self._concrete(args), self._concrete(kwargs))
            finally:
                self._computing = False
        return proxy

    def _concrete(self, args: Any) -> Any:
        return fx.node.map_aggregate(args, lambda a: self.values[a.node] if isinstance(a, Proxy)
                                     else _to_meta(a, self.fake_mode))

    def _compute(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "call_module":
            module = self.root.get_submodule(target)
            tensors = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
            state = {name: _to_meta(t, self.fake_mode) for name, t in tensors}
            return torch.func.functional_call(module, state, args, kwargs, tie_weights=False, strict=False)
        if kind == "get_attr":
            return _to_meta(functools.reduce(getattr, target.split("."), self.root), self.fake_mode)
        return None

    def create_arg(self, a: Any):
        if isinstance(a, Proxy):  # first: a traced tensor passes isinstance(a, torch.Tensor) (_ValueProxy)
            return a.node
        # a tensor the forward made from no inputs: kept here, not set on the user's model as fx would
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) and a not in self.tensor_attrs:
            name = f"_pipeline_constant{len(self.constants)}"
            self.constants[name] = a
            self.tensor_attrs[a] = name
            node = self.create_node("get_attr", name, (), {})
            self.values[node] = _to_meta(a, self.fake_mode)
            return node
        return super().create_arg(a)

    # ------------------------------------------------------------------ Python asks concretely
    def to_bool(self, obj: Proxy) -> bool:
        return bool(self.value(obj))

    def iter(self, obj: Proxy) -> Iterator:
        value = self.value(obj)
        return iter(value) if isinstance(value, dict) else iter([obj[i] for i in range(len(value))])

    def keys(self, obj: Proxy) -> Any:
        return self.value(obj).keys()

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Placeholders for the example's positional inputs, then its keyword tensors in the forward's
        parameter order (fx's own version cannot bind a ``**kwargs`` forward, which HF models have)."""
        signature = inspect.signature(inspect.unwrap(root_fn))
        params = list(signature.parameters.values())[1:]
        self.positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        if len(self.args) > len(self.positional) and not any(p.kind is p.VAR_POSITIONAL for p in params):
            raise TypeError(f"forward takes {len(self.positional)} positional inputs ({list(self.positional)}), the "
                            f"example gives {len(self.args)}")
        try:
            signature.bind_partial(None, *self.args, **self.kwargs)
        except TypeError as error:
            raise TypeError(f"the example inputs do not fit {type(self.root).__name__}.forward{signature}: {error}") \
                from None
        order = [p.name for p in params]  # keywords in the forward's order, any **kwargs after
        keywords = sorted(self.kwargs, key=lambda k: order.index(k) if k in order else len(order))
        traced = [k for k in keywords if isinstance(self.kwargs[k], torch.Tensor)]
        fixed = {k: self.kwargs[k] for k in keywords if k not in traced}  # use_cache=False: as it is
        names = [input_name(self.positional, i) for i in range(len(self.args))] + traced
        self.inputs = (*self.args, *(self.kwargs[k] for k in traced))
        proxies = []
        for name, example in zip(names, self.inputs):
            proxy = self.create_proxy("placeholder", name, (), {})
            self.values[proxy.node] = _to_meta(example, self.fake_mode)
            proxies.append(proxy)
        root, num_args = self.root, len(self.args)
        return (lambda *inputs: root_fn(root, *inputs[:num_args], **dict(zip(traced, inputs[num_args:])),
                                        **fixed)), proxies


def input_name(positional: Sequence[str], index: int) -> str:
    """The placeholder name of the forward's positional input ``index`` (``input_i`` past its named
    parameters, into ``*args``)."""
    return positional[index] if index < len(positional) else f"input_{index}"


def _drop_dead_code(graph: fx.Graph) -> None:
    """Remove ops whose values nothing uses (a comparison only control flow read): they would run for
    nothing and could make a value cross a cut. Layer calls and in-place ops stay."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op not in ("call_function", "call_method", "get_attr"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") or name in ("setitem", "__setitem__"):
            continue
        graph.erase_node(node)
