"""From blocks to plan entries: the zoo's layout, written for whatever modules the blocks are in.

Per block (``patterns.find_blocks``):

- **Parameters.** Column weights ``Shard(<their output-feature dim>)`` (``Shard(0)`` for
  ``nn.Linear``, ``Shard(1)`` for GPT-2's ``Conv1D``), fused ones ``_StridedShard(dim, split_factor=
  <pieces>)``, biases likewise along dim 0; row weights ``Shard(<input-feature dim>)``, row biases
  ``Replicate``.
- **Activations.** A block that reshapes or attends between its linears runs on plain local
  tensors: column outputs leave ``PlacementSpec([Shard(-1)], to_local=True)`` (a fused column's
  patch computes it locally), row inputs come back ``[Shard(-1)]``; a block of per-element ops only
  (an MLP) keeps DTensors throughout, as the zoo does. Row outputs join the residual stream:
  ``Replicate``, or ``Shard(1)`` under sequence parallelism. Columns whose output is the model's
  output (the LM head) gather it (or leave it ``Shard(-1)`` with ``loss_parallel``).
- **Handing the block its input.** Tensor parallel: the module returning the columns' input (a
  norm) hands it over as a plain tensor and the innermost module taking it back gets an input plan
  ``Replicate``, so the backward all-reduce of the columns' partial input gradients runs there, once
  (Megatron's *f*; not needed after ``F.layer_norm``, whose DTensor backward reduces it itself).
  Sequence parallel: that module's output is all-gathered (``[[Replicate()]]``).
- **Embeddings.** A lookup of the model's own input ids is vocab-parallel (``Shard(0)`` and the
  ``vocab_parallel_embedding`` patch), its output the stream; other lookups (learned positions)
  stay replicated and take their plain ids as ``Replicate`` (``Shard(1)`` out under SP).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule.experts.parallel import EXPERT_PATCH
from ndweave.dmodule.infer.entries import Entries, Entry
from ndweave.dmodule.infer.experts import Experts
from ndweave.dmodule.infer.linears import Embedding, Linear
from ndweave.dmodule.infer.modules import Argument, Boundaries, common_ancestor, is_within
from ndweave.dmodule.infer.partials import follow_partials
from ndweave.dmodule.infer.patterns import Block
from ndweave.dmodule.spec import PlacementSpec
from ndweave.mesh.torch_compat import StridedShard

__all__ = ["emit_blocks", "emit_embeddings", "emit_experts", "emit_replicated", "block_module", "input_value"]


def _local(placements: list) -> PlacementSpec:
    return PlacementSpec(placements, to_local=True)


def _stream(sequence_parallel: bool) -> list:
    return [Shard(1)] if sequence_parallel else [Replicate()]


def block_module(block: Block) -> str:
    """The innermost module holding every linear of ``block``."""
    return common_ancestor([lin.module for lin in (*block.columns, *block.rows)])


def input_value(arg: Argument, value: Any) -> Any:
    """An input plan giving ``value`` to the argument ``arg`` (a list by position, a dict by name)."""
    if arg.name is not None:
        return {arg.name: value}
    return [None] * arg.index + [value]


def _pieces(block: Block, column: Linear) -> int:
    base = next((a.base for a in block.adapters if a.up is column), column)  # (an adapter's: its base's pieces)
    return len(block.pieces.get(base.op, ())) or 1


def emit_blocks(entries: Entries, blocks: list[Block], b: Boundaries, model: nn.Module, *,
                sequence_parallel: bool, loss_parallel: bool) -> None:
    """Entries for every block (see the module docstring)."""
    for block in blocks:
        if block.container is not None:
            _emit_container(entries, block, b, sequence_parallel)
            continue
        local = block.reshaping or bool(block.pieces)
        where = block_module(block) or "<root>"
        branch_ups = {a.up.op for a in block.adapters}
        joined_rows = {lin.op: a for a in block.adapters if a.down in block.rows for lin in (a.base, a.down)}
        for column in block.columns:
            k = _pieces(block, column)
            shard = (lambda d: [StridedShard(d, split_factor=k)]) if k > 1 else (lambda d: [Shard(d)])
            why = (f"column-wise: fused output cut into {k} equal pieces, each rank keeps its share of each"
                   if k > 1 else "column-wise: its output features are split over the ranks")
            if column.op in block.gathered:
                why = _GATHERED
            entries.param(column.weight, shard(column.out_dim), f"{why} ({where})")
            if column.bias is not None:
                entries.param(column.bias, shard(0), f"bias of a {why} ({where})")
            outside = block.biases.get(column.op)  # a bias its caller adds to its output
            if outside is not None and column.op in block.gathered:
                entries.param(outside, [Replicate()], f"added by {where} to the gathered logits: replicated")
            elif outside is not None:
                entries.param(outside, shard(0), f"bias of a {why} ({where})")
            if column.op in block.gathered:
                value = [[Shard(-1)]] if loss_parallel else [_local([Replicate()])]
                entries.add("forward", column.module, "output", value,
                            "logits left sharded over the vocabulary for loss_parallel()" if loss_parallel
                            else "logits gathered and handed on plain, so the model's own loss runs unchanged")
            elif k > 1:
                entries.add("patch", column.module, "", {"name": "fused_colwise", "args": {"pieces": k}},
                            "computes its fused output on this rank's [piece_r | ...] and hands it on plain")
            elif local:
                entries.add("forward", column.module, "output", [_local([Shard(-1)])],
                            f"this rank's features handed on plain: {where} reshapes or attends on local tensors")
            if column.op not in branch_ups:  # (its input is the adapter's replicated down projection's output)
                _emit_column_input(entries, column, b, sequence_parallel)
        _emit_adapters(entries, block, b, sequence_parallel)
        for row in block.rows:
            entries.param(row.weight, [Shard(row.in_dim)],
                          f"row-wise: takes the features the columns of {where} split; its output is a partial sum")
            if row.bias is not None:
                entries.param(row.bias, [Replicate()], f"bias of a row-wise linear ({where}): added once")
            if local:
                entries.add("forward", row.module, "input", [[Shard(-1)]],
                            "takes this rank's features back as a DTensor (the local tensors of "
                            f"{where})")
            if row.op in joined_rows:
                continue  # (its partial sum is added to the adapter's: reduced once, at the adapter's module)
            call = b.calls.get(row.module)  # (its module's output: GPT-2's Conv1D multiplies a 2-D view)
            out = b.trace.values[call.outputs[0]] if call is not None and call.outputs else b.trace.values[row.y]
            _reduce_output(entries, row.module, out.shape, sequence_parallel, "row-wise output: the partial sums")
        gathered_only = not block.rows and all(c.op in block.gathered for c in block.columns)
        if local and not gathered_only:  # (a head gathered at its own output: nothing after it sees a shard)
            check = {"name": "tp_divides", "args": {"sizes": sorted(block.sizes)}}
            entries.add("patch", block_module(block), "", check,
                        "checks that the tensor-parallel size divides every sharded size (heads) of the block")
        owners: dict[str, list[str]] = {}
        parameters = dict(model.named_parameters(remove_duplicate=False))
        for name in sorted(n for n in block.inner_params if n in parameters):  # (a buffer has no gradient)
            owner, _, leaf = name.rpartition(".")
            owners.setdefault(owner, []).append(leaf)
        for owner, leaves in owners.items():
            entries.add("patch", owner, "", {"name": "partial_grad_params", "args": {"names": leaves}},
                        f"works on this rank's heads inside {where}: its parameters' gradients are partial sums")


def _emit_adapters(entries: Entries, block: Block, b: Boundaries, sequence_parallel: bool) -> None:
    """A low-rank branch runs with its base (``adapters``): its other projection replicated, its partial
    gradient summed by ``finish_grad_sync()``; after a row-wise base, the two partial sums are reduced
    once, at the module adding them."""
    for adapter in block.adapters:
        column = adapter.up in block.columns
        replicated = adapter.down if column else adapter.up
        entries.param(replicated.weight, [Replicate()],
                      f"an adapter's {'down' if column else 'up'} projection, replicated beside the "
                      f"{'column' if column else 'row'}-wise {adapter.base.module}: the branch costs no collective")
        if replicated.bias is not None:
            entries.param(replicated.bias, [Replicate()], "its bias, likewise")
        if column:
            continue
        out = b.trace.values[b.ops[adapter.join].outputs[0]]
        _reduce_output(entries, adapter.module, out.shape, sequence_parallel,
                       f"{adapter.base.module}'s and its adapter's partial sums, added,")


def _reduce_output(entries: Entries, module: str, shape: tuple[int, ...], sequence_parallel: bool, what: str) -> None:
    """``module``'s output, a partial sum of ``shape``, reduced there: reduce-scattered on the sequence
    under SP where it is (batch, seq, hidden), else all-reduced (a pooled head's output stays whole)."""
    on_sequence = sequence_parallel and len(shape) == 3
    entries.add("forward", module, "output", [_stream(on_sequence)],
                f"{what} reduce-scattered on the sequence (SP)" if on_sequence else f"{what} all-reduced, once" + (
                    " (not (batch, seq, hidden): a pooled head's output stays whole under SP)" if sequence_parallel
                    else ""))


def _shard(block: Block, column: Linear) -> Any:
    k = _pieces(block, column)
    return (lambda d: [StridedShard(d, split_factor=k)]) if k > 1 else (lambda d: [Shard(d)])


def _emit_container(entries: Entries, block: Block, b: Boundaries, sequence_parallel: bool) -> None:
    """A block inside one module's forward (experts as 3-D weights): its parameters cut per linear
    role, the module run whole on local shards (``local_block``), its partial outputs reduced."""
    where = block.container
    for column in block.columns:
        shard = _shard(block, column)
        entries.param(column.weight, shard(column.out_dim), f"column-wise inside {where}'s forward (each expert's "
                      f"{'fused ' if _pieces(block, column) > 1 else ''}up projection split over the ranks)")
        if column.bias is not None:
            entries.param(column.bias, shard(column.out_dim - 1), f"its bias, likewise ({where})")
    for row in block.rows:
        entries.param(row.weight, [Shard(row.in_dim)], f"row-wise inside {where}'s forward: a partial sum")
    outputs = [b.trace.values[v] for v in b.calls[where].outputs]
    plan = [(_stream(sequence_parallel) if len(v.shape) == 3 else [Replicate()]) if partial else None
            for v, partial in zip(outputs, block.partial_outputs)]
    entries.add("forward", where, "output", plan, "its partial sums reduced at its output (reduce-scattered on the "
                "sequence under SP when they are (batch, seq, hidden))")
    entries.add("patch", where, "", {"name": "local_block", "args": {"partial": block.partial_outputs}},
                "runs whole on this rank's shards of its parameters, its inputs handed in whole")
    entries.add("patch", where, "", {"name": "tp_divides", "args": {"sizes": sorted(block.sizes)}},
                "checks that the tensor-parallel size divides every sharded size of the block")


def _emit_column_input(entries: Entries, column: Linear, b: Boundaries, sequence_parallel: bool) -> None:
    chain = b.chain(column.x)
    found = b.producer(chain)
    producer, source = found if found is not None else (None, chain[-1])
    finals = [b.ops[i].module for i in b.final_consumers(source)]
    receiver = b.receiver(chain, finals)
    contained = receiver is not None and all(is_within(m, receiver.module) for m in finals)
    if producer is not None and (sequence_parallel or not contained):
        if sequence_parallel and _free(entries, producer, [[Replicate()]]):
            entries.add("forward", producer, "output", [[Replicate()]],
                        "all-gathered on the sequence before the column-wise linears (SP)")
        return
    if producer is not None and b.last_op(source) == "F.layer_norm":
        return  # DTensor's layer_norm backward reduces the columns' partial input gradient itself
    if receiver is None:
        return
    if producer is not None and b.call_counts.get(producer, 0) > 1:
        # (called again elsewhere, a dropout: its output plan would hand that call's output on plain too)
        producer = None
    if producer is not None:
        if not _free(entries, producer, [_local([Replicate()])]):
            return  # its output is laid out already (an embedding feeding the columns directly)
        entries.add("forward", producer, "output", [_local([Replicate()])],
                    "handed on plain, so the columns' partial input gradient is all-reduced where "
                    f"{receiver.module or '<root>'} takes it back")
    entries.add("forward", receiver.module, "input", input_value(receiver, [Replicate()]),
                "the column-wise linears' input, replicated (its gradient all-reduced here, once)")


def _free(entries: Entries, module: str, value: Any) -> bool:
    """Whether ``module``'s output has no other layout in the plan than ``value``."""
    entry = entries.get("forward", module, "output")
    return entry is None or entry.value == value


def emit_embeddings(entries: Entries, embeddings: list[Embedding], b: Boundaries, model: nn.Module, *,
                    sequence_parallel: bool) -> list[str]:
    """Entries for the embedding lookups; returns a line for each left replicated, with why."""
    notes = []
    inputs = set(b.trace.inputs)
    entries.context = (b, model)

    def vocab_parallel(emb: Embedding) -> bool:
        call = b.calls.get(emb.module)
        linear = call is not None and follow_partials(b.trace, {emb.op: emb.y}, call)[0] is not None
        return b.chain(emb.ids)[-1] in inputs and isinstance(model.get_submodule(emb.module), nn.Embedding) and linear

    # one placement per table, from all of its lookups: a table shared by a lookup that cannot be
    # vocab-parallel (a decoder's ids made from the input ids) is replicated for every lookup
    able = {emb.op: vocab_parallel(emb) for emb in embeddings}
    shared_with_replicated = {emb.weight for emb in embeddings if not able[emb.op]}
    for emb in embeddings:
        if able[emb.op] and emb.weight not in shared_with_replicated:
            entries.param(emb.weight, [Shard(0)], "vocab-parallel embedding: each rank holds a block of rows")
            if len(b.ops_in(emb.module)) == 1:  # its forward is the lookup alone
                entries.add("patch", emb.module, "", "vocab_parallel_embedding",
                            "looks up only this rank's rows; the output is a partial sum")
            else:  # it does more (scales the rows), linearly: checked by the caller
                entries.add("patch", emb.module, "", "vocab_parallel_forward",
                            "its own forward (a scaled lookup) runs on this rank's rows; the output is a partial sum")
            entries.add("forward", emb.module, "output", [_stream(sequence_parallel)],
                        "the partial lookups reduce-scattered on the sequence (SP)" if sequence_parallel
                        else "the partial lookups all-reduced")
            continue
        entries.whole_tables.append(emb.weight)
        notes.append(f"{emb.weight}: replicated (" + (
            "shared with a lookup that cannot be vocab-parallel: one placement for every use)" if able[emb.op]
            else "an embedding of ids other than the model's input ids)" if b.chain(emb.ids)[-1] not in inputs
            else "its module's forward is not linear in the lookup)"))
        arg = b.argument(emb.module, emb.ids)
        if len(b.ops_in(emb.module)) == 1 and arg is not None:
            entries.add("forward", emb.module, "input", input_value(arg, [Replicate()]),
                        "plain ids (positions) meet its replicated weight: taken as Replicate")
        else:  # it computes its ids itself (from a mask, an offset): all of it runs on plain tensors
            entries.add("patch", emb.module, "", "replicated_local",
                        "computes its positions itself: runs on plain tensors, its output Replicate")
        if sequence_parallel and len(b.trace.values[emb.y].shape) == 3:
            entries.add("forward", emb.module, "output", [[Shard(1)]], "joins the sequence-sharded stream (SP)")
    return notes


def emit_experts(entries: Entries, experts: list[Experts]) -> None:
    """The ``expert_parallel`` patch on each experts module: its stacked weights ``Shard(0)`` over
    ``"EP"`` (whole over TP), its tokens moved to them and back."""
    for e in experts:
        entries.add("patch", e.fqn, "", EXPERT_PATCH,
                    f"stacks {e.num_experts} experts on dim 0 of {len(e.params)} parameters and is called with the "
                    "router's top-k: its experts are divided over 'EP', each rank's tokens sent to them and back")


def emit_replicated(entries: Entries, replicated: list[str], called: set[str], kept: set[str] = frozenset()) -> None:
    """The ``replicated_local`` patch on the outermost modules holding replicated linears (their
    weights FQNs in ``replicated``) and no sharded parameter nor a module of ``kept`` (experts
    divided over EP): they then run on plain tensors. Only modules whose forward ran (in
    ``called``) take it: a ``ModuleList`` is never called itself."""
    _replicate_shared(entries, [*replicated, *entries.whole_tables])
    sharded = {f"{e.module}.{e.leaf}" for e in entries.items if e.section == "parameter"}
    chosen: list[str] = []
    for weight in replicated:
        module = weight.rpartition(".")[0]
        best = None
        while module:
            holds = any(is_within(p.rpartition(".")[0], module) for p in sharded) or \
                any(is_within(k, module) for k in kept) or _holds_tied(entries, module, sharded)
            if holds:
                break
            best = module if module in called else best
            module = module.rpartition(".")[0]
        if best is not None and not any(is_within(best, c) for c in chosen):
            chosen = [c for c in chosen if not is_within(c, best)] + [best]
    for fqn in chosen:
        entries.add("patch", fqn, "", "replicated_local",
                    "holds only replicated parameters: runs on plain local tensors, the same on every rank")
    if entries.context is not None:
        _emit_stems(entries, *entries.context)
    entries.add("patch", "", "", "replicate_plain",
                "a plain tensor the model computes or is given (positions, masks, pixel values, an adapter's branch) "
                "that meets a DTensor is taken as Replicate at that op (off after a first forward that needs none)")


_VOCAB_PATCHES = ("vocab_parallel_embedding", "vocab_parallel_forward")
_GATHERED = "column-wise: its output is the model's output, gathered there"
_UNDONE = ("vocab-parallel", _GATHERED)  # layouts that can become Replicate with nothing else changed


def _replicate_shared(entries: Entries, replicated: list[str]) -> None:
    """One placement per parameter, from all of its uses: a weight left replicated for one use (a tied
    LM head with a bias added between its linears) that another use made vocab-parallel (the
    embedding of the encoder and the decoder) is replicated everywhere; those lookups then run on
    the whole table (their ids taken as Replicate), their output plans unchanged."""
    for weight in replicated:
        names = set(entries.aliases.get(weight, [weight]))
        for first, aliases in entries.aliases.items():
            if weight in aliases:
                names.update(aliases)
        modules = {name.rpartition(".")[0] for name in names}
        laid = [e for e in entries.items if e.section == "parameter" and f"{e.module}.{e.leaf}" in names
                and e.value != [Replicate()]]
        if not laid or any(not e.why.startswith(_UNDONE) for e in laid):
            continue  # (a vocab-parallel lookup or a gathered LM head is undone; a block's column or row is not)
        why = (f"replicated: shared by {len(names)} names ({', '.join(sorted(names))}), one of whose uses is left "
               "replicated; one placement for every use")
        kept = []
        for e in entries.items:
            if e.section == "parameter" and f"{e.module}.{e.leaf}" in names:
                e = Entry(e.section, e.module, e.leaf, [Replicate()], why)
            elif e.section == "patch" and e.module in modules and e.value in _VOCAB_PATCHES:
                continue
            kept.append(e)
        entries.items[:] = kept


def _emit_stems(entries: Entries, b: Boundaries, model: nn.Module) -> None:
    """``replicated_local`` on the outermost modules with parameters, none sharded and nothing planned
    inside, whose every call ends before the first op that uses a sharded parameter: what runs before
    the stream (a conv stem, a patch embedding, a feature extractor; all of a model nothing of which
    is sharded but its head) runs on plain local tensors, whatever ops it uses (DTensor has no rule
    for some: pooling and activation backwards, weight norm), and hands the stream a Replicate value."""
    sharded = {f"{e.module}.{e.leaf}" for e in entries.items if e.section == "parameter" and e.value != [Replicate()]}
    start = next((op.index for op in b.trace.ops
                  if any(b.trace.values[v].param in sharded for v in op.inputs)), None)
    planned = {e.module for e in entries.items if e.module}
    calls: dict[str, list] = {}
    for call in b.trace.calls:
        calls.setdefault(call.fqn, []).append(call)
    chosen: list[str] = []
    for fqn in sorted(calls, key=lambda f: f.count(".")):
        if not fqn or any(is_within(fqn, c) for c in chosen) or any(is_within(p, fqn) or is_within(fqn, p)
                                                                    for p in planned):
            continue
        if start is not None and any(call.end_op > start for call in calls[fqn]):
            continue
        params = [n for n, _ in model.get_submodule(fqn).named_parameters()]
        if params and not any(f"{fqn}.{n}" in sharded for n in params):
            chosen.append(fqn)
    for fqn in chosen:
        entries.add("patch", fqn, "", "replicated_local",
                    "runs before the stream with only replicated parameters (a stem, a patch embedding): on plain "
                    "local tensors, the same on every rank, its output Replicate")


def _holds_tied(entries: Entries, module: str, sharded: set[str]) -> bool:
    """Whether ``module`` holds, under its own name, a parameter tied to one the plan lays out."""
    if entries.context is None:
        return False
    model = entries.context[1]
    groups = {n: names for names in entries.aliases.values() for n in names}
    try:
        own = [f"{module}.{n}" for n, _ in model.get_submodule(module).named_parameters(remove_duplicate=False)]
    except AttributeError:
        return False
    return any(alias in sharded for name in own for alias in groups.get(name, [name]))
