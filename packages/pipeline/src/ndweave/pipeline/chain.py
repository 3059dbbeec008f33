"""Models whose forward chains their children, cut without shapes.

veScale users write pipelines over models whose layers are plain attributes (``x = self.mlp1(x);
x = self.mlp2(x); ...``), with no ``ModuleList`` to split and no example inputs: veScale finds the
call order with a symbolic trace (``torch.fx``), which needs no shapes. So does this module, and only
for a forward that is a chain: the input goes through each child once, each child taking the previous
one's output alone, the last one's output returned; ops between children may use those values for
their side effects (``x.retain_grad()``) but not feed them on. Each stage's chunk then runs the traced
forward from its first child on, other stages' children handing their input through. Anything else
(branches on values, several inputs per layer) needs ``example_inputs=`` and the traced cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn

__all__ = ["Chain", "chained_children", "run_chain_stage"]


@dataclass(frozen=True)
class Chain:
    """A forward that chains the model's children, found by a symbolic trace."""

    graph: fx.Graph
    """The root forward, each child one ``call_module`` node."""
    layers: list[str]
    """The children, in the order the forward calls them."""


def chained_children(model: nn.Module) -> tuple[Chain | None, str]:
    """``(Chain, "")`` when ``model``'s forward chains its children (see the module docstring), else
    ``(None, why)``."""
    children = {name for name, _ in model.named_children()}

    class _Children(fx.Tracer):
        def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
            return qualname in children or super().is_leaf_module(module, qualname)

    try:
        graph = _Children().trace(model)
    except Exception as e:  # data-dependent control flow, calls fx cannot proxy: shapes are needed
        first = str(e).splitlines()[0] if str(e) else ""
        return None, f"a symbolic trace stops at {type(e).__name__}: {first}"
    calls = [n for n in graph.nodes if n.op == "call_module"]
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    previous = inputs[0] if len(inputs) == 1 else None
    for node in calls:
        if node.target not in children or node.kwargs or list(node.args) != [previous]:
            return None, f"{node.target!r} is not called on the previous layer's output alone"
        previous = node
    output = next(n for n in graph.nodes if n.op == "output")
    if not calls or output.args[0] is not previous or len({n.target for n in calls}) != len(calls):
        return None, "its forward does not return the last of its children, each called once"
    return Chain(graph, [n.target for n in calls]), ""


def run_chain_stage(chunk: nn.Module, chain: Chain, first_layer: str) -> nn.Module:
    """Make ``chunk`` (a skeleton copy of the model) run the chain from ``first_layer`` on: what came
    before it ran on earlier stages, whose output is this stage's input."""
    nodes = list(chain.graph.nodes)
    start = next(i for i, n in enumerate(nodes) if n.op == "call_module" and n.target == first_layer)
    before = nodes[:start]
    received = nodes[start].args[0]

    def forward(self: nn.Module, x):
        env = dict.fromkeys(before)
        env[received] = x
        return fx.Interpreter(self, graph=chain.graph).run(initial_env=env)

    cls = type(chunk)
    chunk.__class__ = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                  "__doc__": f"{cls.__name__} from {first_layer} on (a pipeline stage)"})
    return chunk
