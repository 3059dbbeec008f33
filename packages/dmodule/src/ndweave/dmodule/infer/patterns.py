"""Megatron's pattern, found in the recorded dataflow: column-wise linears, the ops that can run on
each rank's piece of their output, and the row-wise linears that take it back.

``find_blocks(trace)`` assumes every linear is column-wise and walks the ops in the order they ran,
following the sharded tensor dim of every value (:func:`ndweave.dmodule.infer.ops.follow`):

- a linear whose input is sharded along its last (feature) dim is **row-wise**: its output is a
  partial sum, reduced once, and leaves the region;
- a linear whose input is not sharded starts a region as **column-wise** (its output sharded along
  the features);
- every other op with a sharded input must keep each rank's piece its own (heads reshaped,
  rotary embeddings, attention, activations, gating); ops meeting values of two regions join them
  into one **block** (q, k and v meet in attention; gate and up in the SwiGLU product);
- a slice / split / chunk of a column's own output along its features makes it **fused**
  (``[q | k | v]``, ``[gate | up]``): laid out strided so each rank keeps matching pieces;
- a column's output reaching the model's outputs directly is **gathered** there (the LM head).

An op with no rule for sharded inputs fails its block (``Block.failure`` says which op and why); its
linears are then taken as plain replicated ones and the walk runs again, until nothing fails. Names
are never read: only ops, shapes and which parameter each op multiplies by.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ndweave.dmodule.infer.adapters import Adapter, find_adapters
from ndweave.dmodule.infer.cuts import Cut, Pieces, Unsupported, base_name
from ndweave.dmodule.infer.linears import Linear, find_linears
from ndweave.dmodule.infer.modules import is_within
from ndweave.dmodule.infer.ops import ELEMENTWISE, follow
from ndweave.dmodule.infer.trace import Trace

__all__ = ["Block", "Failure", "find_blocks"]

# ops after which a value is still a projection's own output, features last (Conv1D's view back to
# (batch, seq, out), a cast, dropout with p=0 in the trace)
_KEEPS_FEATURES = frozenset(("view", "reshape", "_unsafe_view", "to", "contiguous", "dropout", "type_as"))


@dataclass
class Block:
    """Column-wise linears, the row-wise linears they feed, and the ops between them."""

    columns: list[Linear] = field(default_factory=list)
    rows: list[Linear] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)
    """Indices of the ops between them that ran on sharded values."""
    pieces: dict[int, set[tuple[int, int]]] = field(default_factory=dict)
    """Column op index -> the (start, stop) ranges its fused output is cut into."""
    gathered: list[int] = field(default_factory=list)
    """Column op indices whose output reaches the model's outputs (gathered there)."""
    sizes: set[int] = field(default_factory=set)
    """Sizes of the sharded dim of every value in the block: the TP size must divide each."""
    values: dict[int, Cut] = field(default_factory=dict)
    """Value id -> how it is cut, for every sharded value of the block."""
    failure: str | None = None
    """Why the block cannot be sharded (the first op that failed), or ``None``."""

    biases: dict[int, str] = field(default_factory=dict)
    """Column op index -> a bias parameter added to its output by a separate op (``x @ W.T + b``)."""
    inner_params: set[str] = field(default_factory=set)
    """Parameters used by the ops between the linears (a norm over each head's features)."""
    reshaping: bool = False
    """Whether anything beyond per-element ops runs between its linears, outside their own
    modules (reshapes into heads, attention): then ranks compute on plain local tensors."""
    container: str | None = None
    """For linears multiplied inside one module's own forward (experts as 3-D weights): that module,
    which then runs on this rank's shards as a whole (``local_block``); else ``None``."""
    partial_outputs: list[bool] | None = None
    """For a container: which tensors it returns are partial sums (set when it is verified)."""
    adapters: list[Adapter] = field(default_factory=list)
    """Low-rank branches added to the outputs of its linears (``adapters``): each runs with its base."""


@dataclass(frozen=True)
class Failure:
    """A linear left replicated, and why."""

    linear: Linear
    reason: str


def find_blocks(trace: Trace, excluded: dict[int, str] | None = None) -> tuple[list[Block], list[Failure]]:
    """The sharded blocks of ``trace`` and the linears left replicated (see the module docstring);
    ``excluded``: op index -> why, for linears known not to be column-wise."""
    linears = find_linears(trace)
    adapters = find_adapters(trace, linears)
    excluded = dict(excluded or {})
    as_row: dict[int, str] = {}  # a row-wise linear of a failed block: that block's reason is its own
    while True:
        blocks = _walk(trace, linears, excluded, adapters)
        failed = [b for b in blocks if b.failure]
        if not failed:
            break
        for block in failed:
            for lin in block.columns:
                excluded[lin.op] = block.failure
            for lin in block.rows:
                as_row.setdefault(lin.op, f"takes the output of {block.columns[0].module}, left replicated: "
                                          f"{block.failure}")
    failures = [Failure(linears[i], as_row.get(i, reason)) for i, reason in excluded.items()]
    # a linear neither in a block nor failed is replicated too (a row of a failed block, say)
    placed = {lin.op for b in blocks for lin in (*b.columns, *b.rows)} | set(excluded)
    placed |= {lin.op for b in blocks for a in b.adapters for lin in (a.down, a.up)}  # (the replicated one)
    failures += [Failure(lin, as_row.get(i, "its input is not sharded and its output is not either"))
                 for i, lin in linears.items() if i not in placed]
    return blocks, sorted(failures, key=lambda f: f.linear.op)


class _Blocks:
    """Union-find over blocks: ops meeting two regions join them."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.blocks: list[Block] = []

    def new(self) -> int:
        self.parent.append(len(self.parent))
        self.blocks.append(Block())
        return len(self.parent) - 1

    def find(self, b: int) -> int:
        while self.parent[b] != b:
            self.parent[b] = self.parent[self.parent[b]]
            b = self.parent[b]
        return b

    def union(self, ids: set[int]) -> int:
        roots = sorted({self.find(b) for b in ids})
        for r in roots[1:]:
            self.parent[r] = roots[0]
        return roots[0]

    def merged(self) -> list[Block]:
        out: dict[int, Block] = {}
        for b, block in enumerate(self.blocks):
            into = out.setdefault(self.find(b), Block())
            into.columns += block.columns
            into.rows += block.rows
            into.ops += block.ops
            into.gathered += block.gathered
            into.sizes |= block.sizes
            into.values.update(block.values)
            for k, v in block.pieces.items():
                into.pieces.setdefault(k, set()).update(v)
            into.failure = into.failure or block.failure
            into.biases.update(block.biases)
            into.inner_params |= block.inner_params
            into.reshaping = into.reshaping or block.reshaping
            into.container = into.container or block.container
            into.adapters += block.adapters
        for block in out.values():
            block.ops.sort()
            block.columns.sort(key=lambda lin: lin.op)
            block.rows.sort(key=lambda lin: lin.op)
        return [b for b in out.values() if b.columns]


def _walk(trace: Trace, linears: dict[int, Linear], excluded: dict[int, str], adapters: list[Adapter]
          ) -> list[Block]:
    shapes = {vid: v.shape for vid, v in trace.values.items()}
    # value id -> the parameter it is, or is made from alone (a norm's ``1 + weight.float()``)
    params = {vid: v.param for vid, v in trace.values.items() if v.param is not None}
    by_weight: dict[str, int] = {}  # weight FQN -> a block using it: one parameter, one block
    uf = _Blocks()
    block_of: dict[int, int] = {}   # value id -> block
    cut_of: dict[int, Cut] = {}     # value id -> how it is cut
    tainted: dict[int, int] = {}    # value id -> block, for values made from a failed op's outputs
    origin: dict[int, int] = {}     # value id -> column op whose very output (features dim) it is

    def fail(bid: int, why: str) -> None:
        block = uf.blocks[uf.find(bid)]
        block.failure = block.failure or why

    def mark(vid: int, bid: int, cut: Cut) -> None:
        block_of[vid], cut_of[vid] = bid, cut
        uf.blocks[bid].sizes.add(cut.size(shapes[vid]))
        uf.blocks[bid].values[vid] = cut

    # modules that are one linear each (nn.Linear, Conv1D): their own reshapes are not the model's
    per_module = Counter(lin.module for lin in linears.values())
    linear_modules = {m for m, n in per_module.items() if n == 1}
    # a low-rank branch follows its base (see ``adapters``): the down projection of a column-wise base
    # and the up projection of a row-wise one run replicated, the other one like the base
    branches = {lin.op: a for a in adapters for lin in (a.down, a.up) if a.base.op not in excluded}
    joins = {a.join: a for a in adapters if a.base.op not in excluded}
    for op in trace.leaves():
        lin = linears.get(op.index)
        adapter = branches.get(op.index)
        if adapter is not None:
            placed = adapter.base.y if adapter.base.y in cut_of else adapter.base.x  # (column, else row)
            if placed in cut_of and lin is (adapter.down if placed == adapter.base.y else adapter.up):
                uf.blocks[uf.find(block_of[placed])].adapters.append(adapter)
                continue
        if lin is not None:
            if lin.weight in by_weight:  # an expert's weight multiplied once per expert: one block
                uf.union({by_weight[lin.weight]} | ({block_of[lin.x]} if lin.x in block_of else set()))
            if lin.x in cut_of:
                bid = uf.find(block_of[lin.x])
                by_weight.setdefault(lin.weight, bid)
                if cut_of[lin.x].dim != len(shapes[lin.x]) - 1 or cut_of[lin.x].outer != 1:
                    fail(bid, f"{op.name} in {op.module or '<root>'} multiplies a value sharded along a dim "
                              "other than its features")
                uf.blocks[bid].rows.append(lin)
            elif lin.op not in excluded:
                bid = uf.new() if lin.weight not in by_weight else uf.find(by_weight[lin.weight])
                by_weight.setdefault(lin.weight, bid)
                uf.blocks[bid].columns.append(lin)
                mark(lin.y, bid, Cut(len(shapes[lin.y]) - 1))
                origin[lin.y] = lin.op
            continue
        sharded = {vid: cut_of[vid] for vid in op.inputs if vid in cut_of}
        sources = {params.get(v) for v in op.inputs}
        if not sharded and len(sources) == 1 and None not in sources:  # made from one parameter alone
            params.update(dict.fromkeys(op.outputs, sources.pop()))  # (1 + weight.float(): still that weight)
        if not sharded:
            # what a failed op made, and all made from it, can still reach the model's outputs
            source = next((tainted[v] for v in op.inputs if v in tainted), None)
            if source is not None:
                tainted.update(dict.fromkeys(op.outputs, source))
            continue
        bid = uf.union({block_of[v] for v in sharded})
        block = uf.blocks[bid]
        block.ops.append(op.index)
        bias = _separate_bias(op, sharded, origin, params, shapes)
        if bias is not None:
            block.biases[origin[bias[0]]] = params[bias[1]]
            sharded[bias[1]] = sharded[bias[0]]
        block.inner_params |= {params[v] for v in op.inputs if v in params and v not in sharded}
        if base_name(op.name) not in ELEMENTWISE and op.module not in linear_modules:
            block.reshaping = True
        try:
            result = follow(op, sharded, shapes)
        except Unsupported as error:
            fail(bid, f"{op.name} in {op.module or '<root>'}: {error}")
            tainted.update(dict.fromkeys(op.outputs, bid))
            continue
        except (IndexError, KeyError, TypeError, ValueError) as error:  # an op spelled in a way the rules miss
            fail(bid, f"{op.name} in {op.module or '<root>'}: not understood ({type(error).__name__}: {error})")
            tainted.update(dict.fromkeys(op.outputs, bid))
            continue
        if isinstance(result, Pieces):
            source = next(iter(sharded))
            if source not in origin:
                fail(bid, f"{op.name} in {op.module or '<root>'} cuts a sharded dim that is not a projection's "
                          "own output")
                continue
            uf.blocks[bid].pieces.setdefault(origin[source], set()).update(result.bounds)
            for out in op.outputs:
                mark(out, bid, Cut(result.dim))
            continue
        for out, cut in result.items():
            mark(out, bid, cut)
        joined = joins.get(op.index)
        if joined is not None and joined.base.op in {origin.get(v) for v in op.inputs}:
            origin[op.outputs[0]] = joined.base.op  # (base + adapter: still the base's own features)
        source = op.inputs[0] if op.inputs else None
        if source in origin and base_name(op.name) in _KEEPS_FEATURES and len(op.outputs) == 1:
            out = op.outputs[0]
            if cut_of.get(out) == Cut(len(shapes[out]) - 1) and shapes[out][-1] == shapes[source][-1]:
                origin[out] = origin[source]
    reaching: set[int] = set()  # blocks whose values reach the model's outputs
    for vid in trace.outputs:
        if vid in cut_of or vid in tainted:
            reaching.add(uf.find(block_of[vid] if vid in cut_of else tainted[vid]))
    for bid in reaching:
        block = uf.blocks[bid]
        # a block with no row-wise linear whose values reach the outputs (an LM head, also one whose
        # logits are scaled or soft-capped after it): its outputs are gathered right at its columns,
        # so whatever follows runs on whole tensors
        if not any(uf.find(b) == bid and uf.blocks[b].rows for b in range(len(uf.blocks))):
            block.failure = None
            block.gathered += [c.op for b in range(len(uf.blocks)) if uf.find(b) == bid for c in uf.blocks[b].columns]
        else:
            fail(bid, "a sharded value reaches the model's outputs from a block with row-wise linears")
    blocks = uf.merged()
    for block in blocks:
        _check_pieces(block, shapes)
        _check_modules(block, linear_modules, trace)
    return blocks


def _separate_bias(op, sharded: dict[int, Cut], origin: dict[int, int], params: dict[int, str],
                   shapes: dict[int, tuple[int, ...]]) -> tuple[int, int] | None:
    """``(output, bias)`` value ids when ``op`` adds a 1-D parameter to a column's own output along its
    features (a linear written ``x @ W.T + b``): that parameter is the column's bias."""
    if base_name(op.name) != "add" or len(op.inputs) != 2 or len(sharded) != 1:
        return None
    out, other = op.inputs if op.inputs[0] in sharded else op.inputs[::-1]
    if out in origin and other in params and shapes[other] == shapes[out][-1:]:
        return out, other
    return None


def _check_modules(block: Block, linear_modules: set[str], trace: Trace) -> None:
    """Plans lay activations out at module boundaries: every linear of a block must be a module of
    its own (an ``nn.Linear``, a ``Conv1D``) holding its weight (under one of its names, if tied), or
    the whole block (linears and the ops between them) runs inside one module's own forward: that
    module is the block's ``container``."""
    aliases = trace.aliases()
    for lin in (*block.columns, *block.rows):
        names = aliases.get(trace.params[lin.weight], [lin.weight])
        if lin.module not in linear_modules or all(n.rpartition(".")[0] != lin.module for n in names):
            break
    else:
        return
    linears = (*block.columns, *block.rows)
    container = linears[0].module
    ops = {op.index: op for op in trace.ops}
    if block.rows and all(lin.module == container for lin in linears) and \
            all(is_within(ops[i].module, container) for i in block.ops):
        block.container = container
    else:
        block.failure = block.failure or (f"{lin.weight} is multiplied inside {lin.module or '<root>'}'s own forward, "
                                          "with the block's other ops outside it: no module boundary to lay it out at")


def _check_pieces(block: Block, shapes: dict[int, tuple[int, ...]]) -> None:
    """Fused outputs must be cut into equal pieces covering them once: DTensor's strided layout
    (``_StridedShard``) keeps rank r's share of each piece, in order, only for equal pieces."""
    for column in block.columns:
        bounds = sorted(block.pieces.get(column.op, ()))
        if not bounds:
            continue
        size = shapes[column.y][-1]
        stops = [0] + [b for _, b in bounds]
        covers = all(a == stops[i] for i, (a, _) in enumerate(bounds)) and stops[-1] == size
        sizes = [b - a for a, b in bounds]
        if not covers:
            block.failure = block.failure or (f"the output of {column.module} is cut into pieces {bounds} that do not "
                                              f"cover its {size} features once")
        elif len(set(sizes)) != 1:
            block.failure = block.failure or (f"the fused output of {column.module} is cut into unequal pieces "
                                              f"{sizes}; DTensor's strided layout needs equal ones")
        else:
            block.sizes.update(sizes)
    if block.failure is None and not block.rows and set(block.gathered) != {c.op for c in block.columns}:
        block.failure = "column-wise outputs that reach no row-wise linear and no model output"
