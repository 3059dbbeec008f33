"""Cutting a model into stages by FQN: the units a stage is made of, and which stage holds each.

A model is seen as a sequence of *layers* in registration order (which is execution order for the
models this is meant for: embeddings, blocks, final norm, head). A module is a layer unless it is a
container (``ModuleList``, ``ModuleDict``, ``Sequential``) or holds one, in which case its children
are looked at instead; the entries of a ``ModuleList`` / ``Sequential`` (the repeated blocks) are
always layers. For nanoGPT the layers are ``transformer.wte``, ``transformer.wpe``,
``transformer.drop``, ``transformer.h.0`` ... ``transformer.h.{n-1}``, ``transformer.ln_f``,
``lm_head``.

Stages are contiguous runs of layers. Layers without parameters (dropout, rotary tables) cost
nothing to keep, and a stage may need them wherever they sit (Llama's ``rotary_emb`` is called on
every stage), so every stage keeps them.

A model traced for the pipeline (``construct_pipeline_stage(..., example_inputs=...)``) is cut in
*execution* order instead (:func:`cut_traced`): any model's children are layers when it holds no
container, a layer holding a split point is opened down to it, and each cut lies just before a
layer's first call, where every value crossing it can travel (:mod:`ndweave.pipeline.order`).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from torch import nn

from ndweave.pipeline.chain import chained_children
from ndweave.pipeline.order import ExecutionOrder

__all__ = ["model_layers", "assign_stages", "holds_layer_container", "traced_layers", "cut_traced"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_LISTS = (nn.ModuleList, nn.Sequential)


def model_layers(model: nn.Module) -> list[str]:
    """FQNs of ``model``'s layers in registration order (see the module docstring); a model without a
    layer container whose forward chains its children, in call order (:mod:`ndweave.pipeline.chain`)."""
    if not holds_layer_container(model):
        chain, why = chained_children(model)
        if chain is None:
            raise ValueError(
                f"{type(model).__name__} has no ModuleList / ModuleDict / Sequential of layers, and its forward "
                f"cannot be cut without shapes ({why}); pass example_inputs= (one micro-batch) to "
                "construct_pipeline_stage to cut it where its forward runs the layers"
            )
        return chain.layers
    layers: list[str] = []
    _walk(model, "", layers, refuse_params=True)
    return layers


def traced_layers(model: nn.Module, split_points: Sequence[str] | None) -> list[str]:
    """The layers a traced model is cut between: :func:`model_layers`' (without its refusals), or
    the model's children when it holds no container; a layer that holds a split point is replaced by
    its children until the split point is a layer or holds layers."""
    if isinstance(model, _LISTS) or _holds_container(model):
        layers: list[str] = []
        _walk(model, "", layers)
    else:
        layers = [name for name, _ in model.named_children()]
    layers = _callable_layers(model, layers)
    for point in split_points or ():
        _check_names(model, point)
        while (owner := next((fqn for fqn in layers if point.startswith(fqn + ".")), None)) is not None:
            at = layers.index(owner)
            layers[at:at + 1] = [f"{owner}.{name}" for name, _ in model.get_submodule(owner).named_children()]
    return layers


def _callable_layers(model: nn.Module, layers: list[str]) -> list[str]:
    """``layers`` with each ``ModuleList`` / ``ModuleDict`` among them replaced by its entries, again
    and again: a forward never calls those containers, only what they hold (x-transformers' layers
    are lists ``[norms, block, residual]`` its forward unpacks)."""
    out: list[str] = []
    for fqn in layers:
        module = model.get_submodule(fqn)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            out += _callable_layers(model, [f"{fqn}.{name}" for name, _ in module.named_children()])
        else:
            out.append(fqn)
    return out


def _walk(module: nn.Module, prefix: str, layers: list[str], refuse_params: bool = False,
          seen: set[int] | None = None) -> None:
    seen = set() if seen is None else seen
    for name, _ in module.named_parameters(recurse=False):
        if refuse_params:
            raise ValueError(
                f"parameter {prefix + name!r} belongs to {type(module).__name__} {prefix[:-1] or '(the root)'!r}, "
                "which the pipeline splits into its children; move it into a submodule so a stage can own it "
                "(or pass example_inputs= to construct_pipeline_stage: the stage that reads it owns it)"
            )
    entries_are_layers = isinstance(module, _LISTS)
    for name, child in module.named_children():
        if not entries_are_layers and _holds_container(child):
            _walk(child, prefix + name + ".", layers, refuse_params, seen)
        elif id(child) not in seen:  # a layer held under two names is one layer, by its first name
            seen.add(id(child))
            layers.append(prefix + name)


def cut_traced(model: nn.Module, order: ExecutionOrder, num_stages: int, split_points: Sequence[str] | None,
               cost: dict[str, float] | None = None) -> list[int]:
    """Where each stage of a traced model begins (node positions in ``order``; the first is 0): at
    ``split_points`` (in execution order), or balanced among the cuts that work by each layer's
    ``cost`` (default: its parameter count). A split point where the forward cannot be cut raises,
    naming the value and the nearest split point that works."""
    layers = order.layers
    starts = [order.calls[fqn][0] for fqn in layers]
    weights = [cost[fqn] if cost else _param_numel(model.get_submodule(fqn)) for fqn in layers]
    if split_points is None:
        cuts = _balanced_cuts(order, starts, weights, num_stages)
    else:
        cuts = [0] + [_cut_at(order, layers, starts, point) for point in _checked_count(split_points, num_stages)]
        for previous, point, cut, before in zip(["(the first stage)", *split_points], split_points, cuts[1:], cuts):
            if cut <= before:
                raise ValueError(
                    f"split point {point!r} runs before {previous!r} in the forward; give split points in the "
                    f"order the layers run: {layers}"
                )
    for stage in range(num_stages):
        held = [fqn for fqn, start in zip(layers, starts) if order.stage_of(cuts, start) == stage]
        if not any(_param_numel(model.get_submodule(fqn)) for fqn in held):
            raise ValueError(f"stage {stage} would hold no parameters (layers {held}); move its split point")
    return cuts


def _checked_count(points: Sequence[str], num_stages: int) -> Sequence[str]:
    if len(points) != num_stages - 1:
        raise ValueError(
            f"{num_stages} stages need {num_stages - 1} split points (where stages 1..{num_stages - 1} begin); "
            f"got {len(points)}: {list(points)}"
        )
    return points


def _cut_at(order: ExecutionOrder, layers: list[str], starts: list[int], point: str) -> int:
    cut = order.cut_before(point)
    if cut is None:
        raise ValueError(f"split point {point!r} never runs in the traced forward; split at a layer that runs: {layers}")
    why = order.blocker(cut)
    if why is not None:
        here = starts.index(cut)
        works = sorted((i for i, start in enumerate(starts) if i and order.blocker(start) is None),
                       key=lambda i: (abs(i - here), i))
        nearest = f"the nearest split point that works: {layers[works[0]]!r}" if works else "no layer boundary works"
        raise ValueError(f"the forward cannot be cut before {point!r}: {why}; {nearest}")
    return cut


def _balanced_cuts(order: ExecutionOrder, starts: list[int], weights: list[int], num_stages: int) -> list[int]:
    """Stages balanced by parameter count, cut only where the forward can be: the layers between two
    cuts that work are one group."""
    groups: list[list[int]] = []
    for i, start in enumerate(starts):
        if not groups or (weights[i] and order.blocker(start) is None):
            groups.append([i])
        else:
            groups[-1].append(i)
    group_starts = _balanced_starts([sum(weights[i] for i in group) for group in groups], num_stages)
    return [0] + [starts[groups[g][0]] for g in group_starts[1:]]


def _check_names(model: nn.Module, point: str) -> None:
    names = [fqn for fqn, _ in model.named_modules() if fqn]
    if point not in names:
        near = difflib.get_close_matches(point, names, n=5, cutoff=0.3)
        raise ValueError(f"split point {point!r} names no module of {type(model).__name__}; nearest FQNs: {near or names[:8]}")


def holds_layer_container(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a ``ModuleList`` / ``ModuleDict`` / ``Sequential`` of layers."""
    return isinstance(model, _LISTS) or _holds_container(model)


def _holds_container(module: nn.Module) -> bool:
    return any(isinstance(m, _CONTAINERS) for m in module.modules())


def _param_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def assign_stages(model: nn.Module, num_stages: int, split_points: Sequence[str] | None,
                  layers: list[str] | None = None) -> list[list[str]]:
    """The layers of each stage: given by ``split_points`` (FQNs where stages 1.. begin) or, when
    ``None``, balanced by parameter count. Every stage gets at least one layer with parameters.
    ``layers``: :func:`model_layers`' answer, where the caller has it already."""
    layers = model_layers(model) if layers is None else layers
    weights = [_param_numel(model.get_submodule(fqn)) for fqn in layers]
    if split_points is None:
        starts = _balanced_starts(weights, num_stages)
    else:
        starts = _starts_from_points(model, layers, split_points, num_stages)
    bounds = [*starts, len(layers)]
    stages = [layers[bounds[i] : bounds[i + 1]] for i in range(num_stages)]
    for index, stage in enumerate(stages):
        if not any(weights[layers.index(fqn)] for fqn in stage):
            raise ValueError(f"stage {index} would hold no parameters (layers {stage}); move its split point")
    return stages


def _starts_from_points(model: nn.Module, layers: list[str], points: Sequence[str], num_stages: int) -> list[int]:
    starts = [0]
    for point in _checked_count(points, num_stages):
        index = _layer_index(model, layers, point)
        if index <= starts[-1]:
            raise ValueError(
                f"split point {point!r} (layer {index}) does not come after the previous stage's start "
                f"{layers[starts[-1]]!r}; give split points in model order, each starting a non-empty stage"
            )
        starts.append(index)
    return starts


def _layer_index(model: nn.Module, layers: list[str], point: str) -> int:
    if point in layers:
        return layers.index(point)
    inside = [i for i, fqn in enumerate(layers) if fqn.startswith(point + ".")]
    if inside:  # a container: its first layer
        return inside[0]
    owner = next((fqn for fqn in layers if point.startswith(fqn + ".")), None)
    if owner is not None:
        raise ValueError(
            f"split point {point!r} lies inside the layer {owner!r}; a stage begins at a whole layer, e.g. {owner!r} "
            "(or pass example_inputs= to construct_pipeline_stage to split inside it)"
        )
    _check_names(model, point)
    raise ValueError(f"split point {point!r} holds no layer to begin a stage with; layers: {layers}")


def _balanced_starts(weights: list[int], num_stages: int) -> list[int]:
    """Start indices of ``num_stages`` contiguous groups minimizing the largest group's weight, each
    starting at a weighted layer (weightless layers join the group before them)."""
    weighted = [i for i, w in enumerate(weights) if w]
    if len(weighted) < num_stages:
        raise ValueError(
            f"the model has {len(weighted)} layers with parameters, too few for {num_stages} stages; "
            "use fewer stages or virtual_chunks"
        )
    # weight of a group spanning weighted layers a..b-1 (plus the weightless layers after each)
    prefix = [0]
    for i in weighted:
        prefix.append(prefix[-1] + weights[i])
    n = len(weighted)
    inf = float("inf")
    # best[k][j]: smallest possible max over k groups covering the first j weighted layers
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    starts, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        starts.append(i)
        j = i
    starts.reverse()
    # the first group also takes any weightless layers before the first weighted one
    return [0] + [weighted[i] for i in starts[1:]]
