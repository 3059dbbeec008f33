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
    it owns (``unread_params``) and, split by time, its measured seconds (``stage_seconds``)."""

    def __init__(self, model: nn.Module, num_stages: int, plan: PipelineParallelPlan, example_inputs,
                 device_type: str) -> None:
        example = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        self.layers = traced_layers(model, plan.split_points)
        order = ExecutionOrder(trace_forward(model, example, self.layers))
        timed = plan.split_points is None and plan.split_method == "time"
        seconds = layer_seconds(model, order.forward, example, device_type) if timed else None
        cuts = cut_traced(model, order, num_stages, plan.split_points, seconds)
        self.stage_layers = self._layers_by_stage(model, order, cuts, num_stages)
        self.stage_seconds = [sum(seconds[fqn] for fqn in held if fqn in seconds) for held in self.stage_layers] \
            if seconds else None
        self.stage_io = [None] + [build_stage_io(order, cuts[s], s, self.stage_layers[s][0]) for s in range(1, num_stages)]
        self.programs = [StageProgram(order, cuts, s, self.stage_io[s], self.stage_io[s + 1] if s + 1 < num_stages else None)
                         for s in range(num_stages)]
        self._own_params = self._params_read_by_stage(model)

    def _layers_by_stage(self, model: nn.Module, order: ExecutionOrder, cuts: list[int],
                         num_stages: int) -> list[list[str]]:
        held: list[list[str]] = [[] for _ in range(num_stages)]
        for fqn, calls in order.calls.items():
            stages = sorted({order.stage_of(cuts, call) for call in calls})
            if len(stages) > 1 and next(model.get_submodule(fqn).parameters(), None) is not None:
                raise ValueError(f"layer {fqn!r} runs on stages {stages} (the forward calls it {len(calls)} times) "
                                 "but its parameters can live on one; choose split points that keep its calls together")
            held[stages[0]].append(fqn)
        held[0] += [fqn for fqn in self.layers if fqn not in order.calls]  # never called: kept by the first
        return held

    def _params_read_by_stage(self, model: nn.Module) -> dict[str, int]:
        """Parameters outside every layer (owned by the root, read by its forward): the stage reading each.
        A layer's weight the root forward reads directly must be read on the layer's stage."""
        reads = {p.stage: {n.target for n in p.graph.nodes if n.op == "get_attr"} for p in self.programs}
        stage_of = {fqn: s for s, held in enumerate(self.stage_layers) for fqn in held}
        for stage, names in reads.items():
            for name in names:
                layer = next((fqn for fqn in self.layers if name.startswith(fqn + ".")), None)
                if layer is not None and stage_of[layer] != stage:
                    raise ValueError(
                        f"the forward reads {name!r} on stage {stage}, but its layer {layer!r} is on stage "
                        f"{stage_of[layer]}; use the layer there (a tied head as a module sharing the weight, "
                        "found across stages) or split so that both are on one stage")
        outside = [name for name, _ in model.named_parameters()
                   if not any(name.startswith(layer + ".") for layer in self.layers)]
        owner: dict[str, int] = {}
        for name in outside:
            readers = [stage for stage, names in reads.items() if name in names]
            if len(readers) > 1:
                raise ValueError(f"parameter {name!r} is read by the forward on stages {readers}; a weight outside "
                                 "the layers can live on one stage: move the split points or the weight into a layer")
            owner[name] = readers[0] if readers else 0
        return owner

    def unread_params(self, stage: int) -> list[str]:
        """Parameters outside the layers that ``stage`` does not own (dropped from its chunk)."""
        return [name for name, owner in self._own_params.items() if owner != stage]
