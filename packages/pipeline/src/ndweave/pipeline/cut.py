"""A traced model cut into stages: trace the root ``forward`` (:mod:`~ndweave.pipeline.trace`), find
the cuts (:func:`~ndweave.pipeline.split.cut_traced`, by split points, parameter counts or measured
time), and give each stage its layers, the values it receives (:class:`~ndweave.pipeline.stage_io.StageIO`)
and its part of the graph (:class:`~ndweave.pipeline.program.StageProgram`)."""

from __future__ import annotations

from torch import nn

from ndweave.pipeline.order import ExecutionOrder
from ndweave.pipeline.plan import PipelineParallelPlan
from ndweave.pipeline.program import StageProgram
from ndweave.pipeline.split import cut_traced, traced_layers
from ndweave.pipeline.stage_io import build_stage_io
from ndweave.pipeline.timing import layer_seconds
from ndweave.pipeline.trace import trace_forward

__all__ = ["TracedCut"]


class TracedCut:
    """A traced model cut into stages: each stage's layers (``stage_layers``), what it receives
    (``stage_io``), the part of the forward it runs (``programs``), the parameters outside the layers
    it owns (``unread_params``) and, split by time, its measured seconds (``stage_seconds``).

    A layer or a parameter the forward uses on several stages (a module called by both an encoder
    and a decoder, DeBERTa's relative embeddings read by every layer) is held by each of them: the
    first holds it (``stage_layers``), the others a copy (``borrowed``), and ``copies`` names each
    such parameter's stages, kept equal as tied weights are (:mod:`~ndweave.pipeline.ties`)."""

    def __init__(self, model: nn.Module, num_stages: int, plan: PipelineParallelPlan, example_inputs,
                 device_type: str) -> None:
        self.layers = traced_layers(model, plan.split_points)
        forward = trace_forward(model, example_inputs, self.layers)
        order = ExecutionOrder(forward)
        timed = plan.split_points is None and plan.split_method == "time"
        seconds = layer_seconds(model, forward, forward.inputs, device_type) if timed else None
        cuts = cut_traced(model, order, num_stages, plan.split_points, seconds)
        self.stage_io = [None] + [build_stage_io(order, cuts[s], s, _first_layer(order, cuts, s))
                                  for s in range(1, num_stages)]
        self.programs = [StageProgram(order, cuts, s, self.stage_io[s], self.stage_io[s + 1] if s + 1 < num_stages else None)
                         for s in range(num_stages)]
        reads = [{n.target for n in p.graph.nodes if n.op == "get_attr"} for p in self.programs]
        self.stage_layers, self.borrowed = self._layers_by_stage(model, order, cuts, num_stages, reads)
        self.stage_seconds = [sum(seconds[fqn] for fqn in held if fqn in seconds) for held in self.stage_layers] \
            if seconds else None
        self.copies: dict[str, tuple[int, ...]] = {}
        """Parameter FQN -> the stages holding a copy of it (only those held by more than one)."""
        self._readers = self._params_read_by_stage(model, reads)

    def _layers_by_stage(self, model: nn.Module, order: ExecutionOrder, cuts: list[int], num_stages: int,
                         reads: list[set[str]]) -> tuple[list[list[str]], list[list[str]]]:
        """Each stage's layers, and the layers it uses but another stage holds (called on several
        stages, or their parameters read there by the forward itself)."""
        held: list[list[str]] = [[] for _ in range(num_stages)]
        borrowed: list[list[str]] = [[] for _ in range(num_stages)]
        for fqn in self.layers:
            callers = {order.stage_of(cuts, call) for call in order.calls.get(fqn, ())}
            readers = {stage for stage, names in enumerate(reads) if any(n.startswith(fqn + ".") for n in names)}
            users = sorted(callers | readers) or [0]  # never used: kept by the first
            held[users[0]].append(fqn)
            if next(model.get_submodule(fqn).parameters(), None) is None:
                continue  # (no parameters: every stage keeps it anyway)
            for stage in users[1:]:
                borrowed[stage].append(fqn)
        order_of: dict[str, int] = {}  # execution order, then the layers never called
        for fqn in [*order.layers, *self.layers]:
            order_of.setdefault(fqn, len(order_of))
        return [sorted(h, key=order_of.get) for h in held], borrowed

    def _params_read_by_stage(self, model: nn.Module, reads: list[set[str]]) -> dict[str, list[int]]:
        """The stages reading each parameter outside every layer (owned by the root, read by its
        forward: each reader holds a copy; none: the first stage); and ``copies`` filled in."""
        outside = [name for name, _ in model.named_parameters()
                   if not any(name.startswith(layer + ".") for layer in self.layers)]
        readers = {name: [stage for stage, names in enumerate(reads) if name in names] or [0] for name in outside}
        holders = {fqn: [s] for s, held in enumerate(self.stage_layers) for fqn in held}
        for stage, layers in enumerate(self.borrowed):
            for fqn in layers:
                holders[fqn].append(stage)
        for fqn, stages in holders.items():
            if len(stages) > 1:
                for name, _ in model.get_submodule(fqn).named_parameters(prefix=fqn):
                    self.copies[name] = tuple(sorted(stages))
        self.copies.update({name: tuple(stages) for name, stages in readers.items() if len(stages) > 1})
        return readers

    def unread_params(self, stage: int) -> list[str]:
        """Parameters outside the layers that ``stage`` does not read (dropped from its chunk)."""
        return [name for name, stages in self._readers.items() if stage not in stages]


def _first_layer(order: ExecutionOrder, cuts: list[int], stage: int) -> str:
    """The layer stage ``stage`` begins with (the first called after its cut)."""
    return next(fqn for fqn, calls in order.calls.items() if order.stage_of(cuts, calls[0]) == stage)
