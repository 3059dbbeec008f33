"""Module boundaries in a trace: which module returned a value, which module took it as an argument
(and under which position or name), which module holds a set of ops. Forward plans are written at
module boundaries, so the planner asks these questions of every activation it hands over."""

from __future__ import annotations

from dataclasses import dataclass

from ndweave.dmodule.infer.cuts import base_name
from ndweave.dmodule.infer.trace import ModuleCall, Ref, Trace

__all__ = ["Argument", "Boundaries", "common_ancestor", "is_within"]

# ops that hand a value on unchanged in content (casts, a full slice, dropout in the trace)
_PASS_THROUGH = frozenset(("to", "contiguous", "dropout", "type_as", "float", "view", "reshape", "_unsafe_view",
                           "flatten"))


@dataclass(frozen=True)
class Argument:
    """How a module call received a value: positional ``index`` or keyword ``name``."""

    module: str
    index: int | None
    name: str | None


def is_within(fqn: str, ancestor: str) -> bool:
    """Whether module ``fqn`` is ``ancestor`` or inside it (``""`` is the root, holding everything)."""
    return ancestor == "" or fqn == ancestor or fqn.startswith(ancestor + ".")


def common_ancestor(fqns: list[str]) -> str:
    """The innermost module holding every module of ``fqns``."""
    parts = [f.split(".") if f else [] for f in fqns]
    common: list[str] = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


class Boundaries:
    """Questions about module boundaries, answered from one trace."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.ops = {op.index: op for op in trace.ops}
        self.consumers = trace.consumers()
        self.calls: dict[str, ModuleCall] = {}
        self.returned_by: dict[int, str] = {}  # value id -> innermost module returning it
        self.call_counts: dict[str, int] = {}  # module -> how many times the forward called it
        for call in trace.calls:  # children return before their parents: the first is innermost
            self.calls.setdefault(call.fqn, call)
            self.call_counts[call.fqn] = self.call_counts.get(call.fqn, 0) + 1
            for vid in call.outputs:
                self.returned_by.setdefault(vid, call.fqn)

    def chain(self, vid: int) -> list[int]:
        """``vid`` and the values it passes through back to its source: casts, reshapes and full
        slices are followed back to an op that computes (through module outputs on the way)."""
        chain = [vid]
        while True:
            value = self.trace.values[vid]
            op = self.ops.get(value.producer) if value.producer is not None else None
            if op is None or not op.inputs or not self._passes(op, vid):
                break
            vid = op.inputs[0]
            chain.append(vid)
        return chain

    def _passes(self, op, out: int) -> bool:
        base = base_name(op.name)
        if base == "getitem":  # only a slice that keeps everything
            return self.trace.values[op.inputs[0]].shape == self.trace.values[out].shape
        return base in _PASS_THROUGH

    def producer(self, chain: list[int]) -> tuple[str, int] | None:
        """``(module, value)``: the innermost module returning a value of ``chain`` (the one furthest
        back: a norm, rather than the model body returning the norm's output reshaped)."""
        for vid in reversed(chain):
            if vid in self.returned_by:
                return self.returned_by[vid], vid
        return None

    def ops_in(self, module: str) -> list[int]:
        """Indices of the ops recorded inside ``module``'s (first) call, its children's included."""
        call = self.calls.get(module)
        return [] if call is None else [i for i in range(call.first_op, call.end_op) if i in self.ops]

    def last_op(self, vid: int) -> str | None:
        """Name of the op that made ``vid``."""
        producer = self.trace.values[vid].producer
        return None if producer is None else self.ops[producer].name

    def final_consumers(self, vid: int) -> list[int]:
        """Ops taking ``vid``, looking through pass-through ops (a full slice, a cast) to the ops that
        compute with it."""
        out: list[int] = []
        for op in self.consumers.get(vid, []):
            if op.outputs == (vid,):  # an in-place op or a cast to the same dtype: the value itself
                continue
            if len(op.outputs) == 1 and self._passes(op, op.outputs[0]):
                out += self.final_consumers(op.outputs[0])
            else:
                out.append(op.index)
        return out

    def argument(self, module: str, vid: int | None = None) -> Argument | None:
        """How ``module``'s (first) call received ``vid`` (``None``: its first tensor argument), or
        ``None`` if it did not."""
        call = self.calls.get(module)
        if call is None:
            return None
        for i, arg in enumerate(call.args):
            if isinstance(arg, Ref) and (vid is None or arg.id == vid):
                return Argument(module, i, None)
        for name, arg in call.kwargs.items():
            if isinstance(arg, Ref) and (vid is None or arg.id == vid):
                return Argument(module, None, name)
        return None

    def receiver(self, chain: list[int], within: list[str]) -> Argument | None:
        """The innermost module holding every module of ``within`` whose call took a value of
        ``chain`` as an argument, walking out from their common ancestor; ``None`` if none did."""
        fqn = common_ancestor(within)
        while True:
            for vid in chain:
                found = self.argument(fqn, vid)
                if found is not None:
                    return found
            if not fqn:
                return None
            fqn = fqn.rpartition(".")[0]
