"""``StageProgram``: the part of the traced root ``forward`` one stage runs, on the stage's chunk.

A chunk of a traced model is still the user's model class (its config, methods and FQNs), with a
``forward`` that runs this stage's nodes of the graph (their Python, as fx generates a ``GraphModule``'s,
with the chunk as ``self``, so each layer call is a call of the chunk's own module, hooks and tensor
parallelism included):

* the first stage takes the model's own inputs (positional or by keyword, bound to the traced
  forward's inputs by name); a later one the flat tensors of its
  :class:`~ndweave.pipeline.stage_io.StageIO`;
* the last stage returns the model's output; an earlier one the flat tensors of the next cut.

As ``fully_shard`` and fx's ``GraphModule`` do, the chunk gets a class of its own (a subclass of the
model's) whose ``forward`` is the stage's: ``isinstance(chunk, GPT)`` still holds.
"""

from __future__ import annotations

import itertools
import linecache
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ndweave.mesh.torch_compat import local_tensor, tree_flatten
from ndweave.pipeline.order import ExecutionOrder
from ndweave.pipeline.stage_io import StageIO
from ndweave.pipeline.trace import input_name

__all__ = ["StageProgram", "stage_program", "run_as_stage"]

_ATTR = "_pipeline_stage_program"


class StageProgram:
    """Stage ``stage``'s nodes of the traced forward, between its incoming and outgoing cuts."""

    def __init__(self, order: ExecutionOrder, cuts: list[int], stage: int, inputs: StageIO | None,
                 outputs: StageIO | None) -> None:
        self.stage = stage
        self.inputs = inputs
        """What this stage receives (``None`` on the first stage: the model's inputs)."""
        self.outputs = outputs
        """What this stage sends (``None`` on the last stage: it returns the model's output)."""
        self.graph = _stage_graph(order, cuts, stage)
        self.input_names = tuple(node.target for node in self.graph.nodes if node.op == "placeholder") \
            if inputs is None else ()
        """The first stage's: the traced forward's inputs, in order (its placeholders)."""
        self.positional = order.forward.positional
        used = {node.target for node in self.graph.nodes if node.op == "get_attr"}
        self.constants = {name: t for name, t in order.forward.constants.items() if name in used}
        self._forward = _python(self.graph, self.stage)
        self._constants: tuple[torch.device | None, dict[str, torch.Tensor]] = (None, {})
        self.sent: tuple[torch.Tensor, ...] = ()
        """The tensors the last call sent, as the graph computed them (before any wrapper's output
        hook, e.g. ``use_local_output``, turned a replicated DTensor into a plain tensor)."""

    def run(self, chunk: nn.Module, args: tuple, kwargs: dict[str, Any] | None = None) -> Any:
        device = _device((args, kwargs), chunk)
        if self.inputs is None:
            values = self.bind(args, kwargs or {})
        elif kwargs:
            raise TypeError(f"stage {self.stage} takes the tensors the stage before sends, positionally; got the "
                            f"keyword inputs {list(kwargs)}")
        else:
            values = self.inputs.unflatten(args, device)
        on, constants = self._constants
        if on != device:  # (moved once per device, not per micro-batch)
            constants = {name: t.to(device) for name, t in self.constants.items()}
            self._constants = (device, constants)
        out = self._forward(_Root(chunk, constants) if constants else chunk, *values)
        if self.outputs is None:
            return out
        # a value handed through unchanged is cloned: torch detaches stage outputs in place
        self.sent = tuple(t.clone() if any(t is a for a in args) else t
                          for t in self.outputs.flatten(out, device))
        return self.sent

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """The first stage's inputs in the traced order, from the forward's ``args`` and ``kwargs``
        (bound by name, as the forward binds them)."""
        if not kwargs and len(args) == len(self.input_names):
            return list(args)
        given = {input_name(self.positional, i): value for i, value in enumerate(args)}
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(f"the first stage got input {name!r} twice (positionally and by keyword)")
            given[name] = value
        missing = [name for name in self.input_names if name not in given]
        unknown = [name for name in given if name not in self.input_names]
        if missing or unknown:
            raise TypeError(
                f"the first stage was traced with the inputs {list(self.input_names)}; this batch "
                + (f"lacks {missing}" if missing else "") + (" and " if missing and unknown else "")
                + (f"has {unknown}, which the trace did not take" if unknown else "")
                + ": pass the inputs example_inputs had (their names: the forward's parameters)")
        return [given[name] for name in self.input_names]

    def code(self) -> str:
        """The stage's part of the forward as Python (what ``forward`` runs)."""
        return self.graph.python_code("self").src


def _stage_graph(order: ExecutionOrder, cuts: list[int], stage: int) -> fx.Graph:
    nodes = order.nodes
    start = cuts[stage]
    end = cuts[stage + 1] if stage + 1 < len(cuts) else len(nodes)
    graph, env = fx.Graph(), {}

    def arg(node: fx.Node) -> fx.Node:
        if node not in env:  # a parameter or constant this stage reads (every stage fetches its own)
            env[node] = graph.node_copy(node)
        return env[node]

    incoming = [n for n in nodes if n.op == "placeholder"] if stage == 0 else order.crossing(start)
    for node in incoming:
        env[node] = graph.node_copy(node) if stage == 0 else graph.placeholder(node.name)
    for node in nodes[start:end]:
        if node.op not in ("placeholder", "output", "get_attr"):
            env[node] = graph.node_copy(node, arg)
    if end == len(nodes):
        graph.output(fx.node.map_arg(nodes[-1].args[0], arg))
    else:
        graph.output(tuple(arg(node) for node in order.crossing(end)))
    return graph


def _python(graph: fx.Graph, stage: int) -> Callable[..., Any]:
    """The stage's graph as a Python function of ``(self, *inputs)``, as fx's ``GraphModule`` generates
    it: each node one line, where ``fx.Interpreter`` spent a few Python calls per node per micro-batch.
    ``self`` is the chunk (a layer call is the chunk's own module, hooks included), read when called."""
    code = graph.python_code("self")
    namespace = dict(code.globals)
    name = f"<pipeline stage {stage}, program {next(_PROGRAMS)}>"
    # in linecache (as fx registers a GraphModule's code), so a traceback through it shows each line;
    # an entry without an mtime is never checked against a file, so it stays
    linecache.cache[name] = (len(code.src), None, code.src.splitlines(keepends=True), name)
    exec(compile(code.src, name, "exec"), namespace)  # noqa: S102 (fx's own code)
    return namespace["forward"]


_PROGRAMS = itertools.count()  # each program's code its own linecache entry


class _Root:
    """The chunk, with the traced constants (``_pipeline_constant<N>``, fetched by ``get_attr``) beside
    its attributes: not set on the chunk, whose state they are not."""

    __slots__ = ("_chunk", "_constants")

    def __init__(self, chunk: nn.Module, constants: dict[str, torch.Tensor]) -> None:
        self._chunk, self._constants = chunk, constants

    def __getattr__(self, name: str) -> Any:
        constant = self._constants.get(name)
        return constant if constant is not None else getattr(self._chunk, name)


def _device(args: tuple, chunk: nn.Module) -> torch.device:
    # lazily: the first tensor decides, and listing every parameter per micro-batch cost ~2 ms
    for t in itertools.chain(tree_flatten(args)[0], chunk.parameters(), chunk.buffers()):
        if isinstance(t, torch.Tensor) and local_tensor(t).device.type != "meta":
            return local_tensor(t).device
    return torch.device("cpu")


def _stage_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return stage_program(self).run(self, args, kwargs)


def run_as_stage(chunk: nn.Module, program: StageProgram) -> nn.Module:
    """Make ``chunk`` (a skeleton copy of the model) run ``program`` as its ``forward``."""
    cls = type(chunk)
    chunk.__class__ = type(cls.__name__, (cls,), {"forward": _stage_forward, "__module__": cls.__module__,
                                                  "__doc__": f"{cls.__name__} running pipeline stage {program.stage}"})
    setattr(chunk, _ATTR, program)
    return chunk


def stage_program(module: nn.Module) -> StageProgram | None:
    """The :class:`StageProgram` of a traced chunk, looked up through wrappers (``DDP(chunk)``)."""
    for sub in module.modules():
        program = sub.__dict__.get(_ATTR)
        if program is not None:
            return program
    return None
