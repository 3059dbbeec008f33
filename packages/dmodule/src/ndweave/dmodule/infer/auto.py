"""``auto_plan(model)``: a tensor / sequence-parallel plan derived from one traced forward.

    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    model = parallelize_module(model, tp_mesh, get_plan("auto", model, sequence_parallel=True))

Steps, each its own module: trace one forward of a meta copy (``ndweave.dmodule.infer.trace``: no weights
copied, nothing computed; a fake copy, fake CPU tensors, when the forward fails on meta) -> find the
linears and embeddings (``linears``) -> find the Megatron blocks in the dataflow (``patterns``) ->
check each block on the shapes every rank would see, and find the head-count attributes its forward
reshapes with (``verify``) -> write the zoo's layout for them (``emit``). Everything not in a block
stays replicated; :func:`derive` says why for each. With ``expert_parallel=True`` the experts modules
(``experts``: found from parameter shapes and the traced call) are kept out of every block and divided
over ``"EP"`` (the ``expert_parallel`` patch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ndweave.dmodule.infer.attention import emit_torch_attention, find_torch_attention
from ndweave.dmodule.infer.emit import block_module, emit_blocks, emit_embeddings, emit_experts, emit_replicated
from ndweave.dmodule.infer.entries import Entries
from ndweave.dmodule.infer.experts import Experts, expert_lists, find_experts
from ndweave.dmodule.infer.inputs import Guess, guesses, what_was_read
from ndweave.dmodule.infer.linears import find_embeddings, find_linears
from ndweave.dmodule.infer.modules import Boundaries
from ndweave.dmodule.infer.partials import partial_outputs
from ndweave.dmodule.infer.patterns import Block, Failure, find_blocks
from ndweave.dmodule.infer.verify import Verdict, verify_block
from ndweave.dmodule.infer.trace import Trace, meta_copy, shape_only, trace
from ndweave.mesh.torch_compat import FakeTensorMode

__all__ = ["Derivation", "auto_plan", "derive", "guess_inputs"]

# Tensor methods that only set autograd's flags on a tensor, in place, and hand it back unchanged. A
# forward hook may run one inside a module's call: transformers' gradient checkpointing puts
# ``output.requires_grad_(True)`` on the input embeddings (so that checkpointed layers take an input
# requiring grad), which would read as a lookup that is not alone in its forward
_AUTOGRAD_FLAGS = frozenset(("Tensor.requires_grad_",))


@dataclass
class Derivation:
    """What :func:`derive` found: the entries (with reasons) and what stays replicated."""

    entries: Entries
    replicated: list[str] = field(default_factory=list)
    """One line per linear or embedding left replicated: its parameter and why (with
    ``expert_parallel``, also each experts candidate not divided over EP)."""
    trace: Trace | None = None
    seconds: float = 0.0
    """Time taken (trace and analysis)."""
    modules: list[str] = field(default_factory=list)
    """Every module FQN of the model (plan keys are matched against them)."""

    def plan(self) -> dict[str, Any]:
        return self.entries.plan(self.modules)


def _verified_blocks(recorded: Trace, boundaries: Boundaries, twin: nn.Module, excluded: dict[int, str]
                     ) -> tuple[list[Block], list[Failure], dict[str, tuple[tuple[str, ...], str]]]:
    """Blocks that pass :func:`verify_block` (others fail and the walk runs again without them), and
    the attributes each block's module needs divided. Blocks of one module class with the same
    relative layout and input shapes (the layers of a stack) are verified once. ``excluded``: op
    index -> why, for linears kept out of every block from the start (experts divided over EP)."""
    excluded = dict(excluded)
    verdicts: dict[tuple, Verdict] = {}
    while True:
        blocks, failures = find_blocks(recorded, excluded)
        attributes: dict[str, tuple[tuple[str, ...], str]] = {}
        failed = False
        for block in blocks:
            if block.container is not None:
                block.partial_outputs, why = partial_outputs(recorded, block, boundaries.calls[block.container])
                if block.partial_outputs is None:
                    excluded.update({c.op: f"{block.container}: {why}" for c in block.columns})
                    failed = True
                    continue
            stray = _stray_inner_params(recorded, block)
            if stray:
                excluded.update({c.op: f"{block_module(block) or '<root>'}: {stray}" for c in block.columns})
                failed = True
                continue
            if not (block.reshaping or block.pieces or block.container):
                continue
            key = _signature(block, boundaries, twin)
            if key not in verdicts:
                verdicts[key] = verify_block(block, boundaries, twin)
            verdict = verdicts[key]
            if verdict.attributes is None:
                excluded.update({c.op: f"{block_module(block) or '<root>'}: {verdict.why}" for c in block.columns})
                failed = True
            elif verdict.attributes:
                attributes[block_module(block)] = (verdict.attributes, verdict.why)
        if not failed:
            return blocks, failures, attributes


def _stray_inner_params(recorded: Trace, block: Block) -> str | None:
    """Why a parameter used on this rank's heads inside ``block`` cannot get a partial gradient
    (it is also used outside the block, where every rank computes its whole gradient), or ``None``."""
    inside = set(block.ops)
    for name in sorted(block.inner_params):
        made = {recorded.params[name]}  # the parameter and what is made from it alone (weight.float())
        for op in recorded.leaves():
            if op.inputs and set(op.inputs) <= made:
                made.update(op.outputs)
            elif made & set(op.inputs) and op.index not in inside:
                return f"{name} is used both on this rank's heads and outside the block"
    if block.inner_params and (block.container is not None or not (block.reshaping or block.pieces)):
        return f"parameters {sorted(block.inner_params)} used between its linears"
    return None


def _signature(block: Block, b: Boundaries, twin: nn.Module) -> tuple:
    fqn = block_module(block)
    prefix = len(fqn) + 1 if fqn else 0
    call = b.calls.get(fqn)
    shapes = tuple(b.trace.values[v].shape for v in call.outputs) if call else ()
    layout = tuple((lin.module[prefix:], lin.out_dim, lin.in_dim) for lin in (*block.columns, *block.rows))
    return (type(twin.get_submodule(fqn)), layout, tuple(sorted((k, tuple(v)) for k, v in block.pieces.items()
                                                                 if False)), shapes, tuple(sorted(block.sizes)))


def guess_inputs(model: nn.Module) -> tuple[tuple, dict]:
    """``(args, kwargs)`` on meta for a trace: the first of :func:`~ndweave.dmodule.infer.inputs.guesses`
    (a decoder LM's token ids ``(2, 8)``; a vision model's ``pixel_values`` sized from its config; an
    encoder-decoder's ids and decoder ids ...). :func:`derive` tries the others in turn where it fails.
    Raises when nothing can be guessed: then pass ``example_inputs=`` (any device: only shapes are used)."""
    first = _guesses(model)[0]
    return first.args, first.kwargs


def _guesses(model: nn.Module) -> list[Guess]:
    found = guesses(model)
    if not found:
        raise ValueError(f"auto plan: cannot guess the inputs of {type(model).__name__} ({what_was_read(model)}); "
                         "pass example_inputs=(args, kwargs) with tensors of the shapes it takes (any device: only "
                         "shapes are read)")
    return found


def _without_autograd_flags(recorded: Trace) -> Trace:
    """``recorded`` without the ops of ``_AUTOGRAD_FLAGS``: they carry no data, so the plan of a model
    is the same with such hooks on or off."""
    ops = [op for op in recorded.ops if not (op.name in _AUTOGRAD_FLAGS and op.outputs == op.inputs[:1])]
    return replace(recorded, ops=ops)


def _shape_only(obj: Any, fake_mode: FakeTensorMode | None = None) -> Any:
    """``obj`` with every tensor replaced by an empty one of its shape and dtype (meta, or fake)."""
    if isinstance(obj, torch.Tensor):
        return shape_only(obj.shape, obj.dtype, fake_mode)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_shape_only(x, fake_mode) for x in obj)
    if isinstance(obj, dict):
        return {k: _shape_only(v, fake_mode) for k, v in obj.items()}
    return obj


def _trace_without_data(model: nn.Module, example_inputs: tuple[tuple, dict] | None) -> tuple[Trace, nn.Module]:
    """The trace of one forward of a meta copy of ``model``, or where that fails, of a fake copy
    (fake CPU tensors: a forward may use its tensors' device, ``torch.autocast(x.device.type)``, which
    fails on "meta"), and the copy traced. Meta first: it is faster. Without ``example_inputs``, each
    guess in turn (see :func:`guess_inputs`), the first that runs kept: a wrong guess fails the forward."""
    candidates = [Guess(*example_inputs)] if example_inputs is not None else _guesses(model)
    tried = []
    for inputs in candidates:
        failures = []
        for fake in (False, True):
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
            twin = meta_copy(model, fake_mode)  # (a fresh copy each time: a failed forward may have left state)
            args, kwargs = _shape_only((inputs.args, inputs.kwargs), fake_mode)
            try:
                with torch.no_grad():
                    return trace(twin, *args, **kwargs), twin
            except Exception as error:  # noqa: BLE001 (any failure of the model's code is the answer)
                why = str(error) if len(candidates) == 1 else (str(error).strip().splitlines() or [""])[0][:240]
                failures.append(f"on {'fake' if fake else 'meta'}: {type(error).__name__}: {why}")
                cause = error
        tried.append(f"{inputs.describe()} ({'; '.join(failures)})")
    raise ValueError(f"auto plan: {type(model).__name__}'s forward failed on "
                     + (f"inputs {tried[0]}" if len(tried) == 1 else
                        f"each of {len(tried)} guessed inputs: " + "; ".join(f"[{i}] {t}" for i, t in enumerate(tried)))
                     + "; pass example_inputs=(args, kwargs) it accepts") from cause


def derive(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = False,
           expert_parallel: bool = False, example_inputs: tuple[tuple, dict] | None = None) -> Derivation:
    """Trace ``model`` on meta (or fake) tensors and derive its plan entries (see the module docstring);
    ``expert_parallel``: its experts modules divided over ``"EP"`` instead of sharded over TP."""
    start = time.perf_counter()
    if expert_parallel and sequence_parallel:
        raise ValueError("auto plan: expert_parallel=True with sequence_parallel=True is not written yet (the "
                         "experts take every token whole on each tensor-parallel rank); pass sequence_parallel=False")
    recorded, twin = _trace_without_data(model, example_inputs)
    recorded = _without_autograd_flags(recorded)
    boundaries = Boundaries(recorded)
    experts, replicated = _experts(boundaries, twin, model) if expert_parallel else ([], [])
    in_experts = {name for e in experts for name in e.params}
    excluded = {lin.op: "divided over EP" for lin in find_linears(recorded).values() if lin.weight in in_experts}
    blocks, failures, attributes = _verified_blocks(recorded, boundaries, twin, excluded)
    failures = [f for f in failures if f.linear.weight not in in_experts]
    entries = Entries(aliases={names[0]: names for names in recorded.aliases().values()})
    gathered = [b for b in blocks if b.gathered]
    if loss_parallel and not gathered:
        raise ValueError("auto plan: loss_parallel=True shards logits over the vocabulary, but no column-wise "
                         f"output of {type(model).__name__} reaches its outputs (no LM head found)")
    replicated += emit_embeddings(entries, list(find_embeddings(recorded).values()), boundaries, twin,
                                  sequence_parallel=sequence_parallel)
    emit_blocks(entries, blocks, boundaries, twin, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    for module, (names, why) in attributes.items():
        entries.add("patch", module, "", {"name": "divide_attributes", "args": {"names": list(names)}},
                    f"its forward reshapes with these literal sizes: {why}")
    emit_experts(entries, experts)
    attention, skipped = find_torch_attention(recorded)
    emit_torch_attention(entries, attention, sequence_parallel=sequence_parallel)
    inside = {op.index for op in recorded.ops if op.parent in {a.op for a in attention}}
    failures = [f for f in failures if f.linear.op not in inside]
    replicated += list(skipped.values())
    emit_replicated(entries, list(dict.fromkeys(f.linear.weight for f in failures)), set(boundaries.calls),
                    kept={e.fqn for e in experts})
    replicated += [f"{f.linear.weight}: replicated ({f.reason})" for f in failures]
    modules = [fqn for fqn, _ in model.named_modules()]
    return Derivation(entries, list(dict.fromkeys(replicated)), recorded, time.perf_counter() - start, modules)


def _experts(b: Boundaries, twin: nn.Module, model: nn.Module) -> tuple[list[Experts], list[str]]:
    """The experts modules to divide over EP, and a line for each candidate that is not; raises when
    there are none (an ``"EP"`` dim would have nothing to divide)."""
    experts, refused = find_experts(b, twin)
    lists = expert_lists(b, twin)
    refused += [f"{fqn}: not expert parallel, planned like the dense layers (experts kept as separate modules "
                "in a ModuleList: the expert-parallel dispatch takes one module stacking them)" for fqn in lists]
    if experts:
        return experts, refused
    why = (f"its experts are separate modules in a ModuleList ({', '.join(repr(f) for f in lists)}), which the "
           "dispatch cannot divide: stack each layer's experts into one module whose parameters are (E, ...) and "
           "whose forward takes (hidden (T, H), top_k_index (T, k), top_k_weights (T, k)), as transformers' MoE "
           "models do" if lists else "it has no module stacking experts' weights on dim 0 and called as (hidden "
           "(T, H), top_k_index (T, k), top_k_weights (T, k))")
    found = f" ({'; '.join(refused)})" if refused and not lists else ""
    raise ValueError(f"auto plan: expert_parallel=True, but {type(model).__name__} has no experts the plan can divide "
                     f"over 'EP': {why}{found}. Without experts, leave expert_parallel off and make the 'EP' ranks "
                     "data parallel")


def auto_plan(model: nn.Module | None = None, *, sequence_parallel: bool = False, loss_parallel: bool = False,
              expert_parallel: bool = False, example_inputs: tuple[tuple, dict] | None = None) -> dict[str, Any]:
    """The plan :func:`derive` finds for ``model``: an ordinary plan dict (edit it, ``save_plan`` it)."""
    if model is None:
        raise ValueError('get_plan("auto") derives the plan from the model: pass it, get_plan("auto", model)')
    return derive(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                  expert_parallel=expert_parallel, example_inputs=example_inputs).plan()
