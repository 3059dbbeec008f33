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
from ndweave.dmodule.infer.entries import Entries
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
    return len(block.pieces.get(column.op, ())) or 1


def emit_blocks(entries: Entries, blocks: list[Block], b: Boundaries, model: nn.Module, *,
                sequence_parallel: bool, loss_parallel: bool) -> None:
    """Entries for every block (see the module docstring)."""
    for block in blocks:
        if block.container is not None:
            _emit_container(entries, block, b, sequence_parallel)
            continue
        local = block.reshaping or bool(block.pieces)
        where = block_module(block) or "<root>"
        for column in block.columns:
            k = _pieces(block, column)
            shard = (lambda d: [StridedShard(d, split_factor=k)]) if k > 1 else (lambda d: [Shard(d)])
            why = (f"column-wise: fused output cut into {k} equal pieces, each rank keeps its share of each"
                   if k > 1 else "column-wise: its output features are split over the ranks")
            if column.op in block.gathered:
                why = "column-wise: its output is the model's output, gathered there"
            entries.param(column.weight, shard(column.out_dim), f"{why} ({where})")
            for bias in (column.bias, block.biases.get(column.op)):
                if bias is not None:
                    entries.param(bias, shard(0), f"bias of a {why} ({where})")
            if column.op in block.gathered:
                value = [[Shard(-1)]] if loss_parallel else [_local([Replicate()])]
                entries.add("forward", column.module, "output", value,
                            "logits left sharded over the vocabulary for loss_parallel()" if loss_parallel
                            else "logits gathered and handed on plain, so the model's own loss runs unchanged")
            elif k > 1:
                entries.add("patch", column.module, "", {"name": "fused_colwise", "args": {"pieces": k}},
                            f"computes its fused output on this rank's [piece_r | ...] and hands it on plain")
            elif local:
                entries.add("forward", column.module, "output", [_local([Shard(-1)])],
                            f"this rank's features handed on plain: {where} reshapes or attends on local tensors")
            _emit_column_input(entries, column, b, sequence_parallel)
        for row in block.rows:
            entries.param(row.weight, [Shard(row.in_dim)],
                          f"row-wise: takes the features the columns of {where} split; its output is a partial sum")
            if row.bias is not None:
                entries.param(row.bias, [Replicate()], f"bias of a row-wise linear ({where}): added once")
            if local:
                entries.add("forward", row.module, "input", [[Shard(-1)]],
                            "takes this rank's features back as a DTensor (the local tensors of "
                            f"{where})")
            entries.add("forward", row.module, "output", [_stream(sequence_parallel)],
                        "row-wise output: the partial sums reduce-scattered on the sequence (SP)" if sequence_parallel
                        else "row-wise output: the partial sums all-reduced, once")
        if local:
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
    for emb in embeddings:
        call = b.calls.get(emb.module)
        linear = call is not None and follow_partials(b.trace, {emb.op: emb.y}, call)[0] is not None
        if b.chain(emb.ids)[-1] in inputs and isinstance(model.get_submodule(emb.module), nn.Embedding) and linear:
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
        notes.append(f"{emb.weight}: replicated (" + ("an embedding of ids other than the model's input ids)"
                     if b.chain(emb.ids)[-1] not in inputs else "its module's forward is not linear in the lookup)"))
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
    sharded = {f"{e.module}.{e.leaf}" for e in entries.items if e.section == "parameter"}
    chosen: list[str] = []
    for weight in replicated:
        module = weight.rpartition(".")[0]
        best = None
        while module:
            holds = any(is_within(p.rpartition(".")[0], module) for p in sharded) or \
                any(is_within(k, module) for k in kept)
            if holds:
                break
            best = module if module in called else best
            module = module.rpartition(".")[0]
        if best is not None and not any(is_within(best, c) for c in chosen):
            chosen = [c for c in chosen if not is_within(c, best)] + [best]
    for fqn in chosen:
        entries.add("patch", fqn, "", "replicated_local",
                    "holds only replicated parameters: runs on plain local tensors, the same on every rank")
