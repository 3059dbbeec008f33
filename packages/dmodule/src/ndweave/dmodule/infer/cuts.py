"""What the op rules (:mod:`ndweave.dmodule.infer.ops`, :mod:`ndweave.dmodule.infer.reshapes`) share:
how a value is cut along a sharded dim (:class:`Cut`), the pieces a split makes (:class:`Pieces`),
the error an op without a rule raises (:class:`Unsupported`), op names reduced to their base
(:func:`base_name`) and the argument helpers every rule uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ndweave.dmodule.infer.trace import Op, Ref

__all__ = ["Cut", "Cuts", "Pieces", "Shapes", "Unsupported", "arg", "base_name", "norm_dim", "one_output",
           "single_input", "sizes"]


class Unsupported(Exception):
    """An op the planner cannot run on per-rank pieces; the message says why."""


@dataclass(frozen=True)
class Cut:
    """Tensor dim ``dim`` is ``outer x size x inner`` (row-major) and ``size`` is what the ranks
    split: each holds a contiguous ``size / tp`` block of it, for every outer and inner index. A
    plain ``Shard(dim)`` has ``outer == 1``."""

    dim: int
    outer: int = 1
    inner: int = 1

    def size(self, shape: tuple[int, ...]) -> int:
        """The extent the ranks split."""
        return shape[self.dim] // (self.outer * self.inner)

    def at(self, dim: int) -> "Cut":
        return Cut(dim, self.outer, self.inner)

    @staticmethod
    def of(dim: int, outer: int, inner: int) -> "Cut":
        """With ``outer == 1`` each rank holds one contiguous block of the dim whatever ``inner`` is
        (heads repeated for grouped-query attention cut like the query heads): drop it."""
        return Cut(dim, outer, inner if outer > 1 else 1)


@dataclass(frozen=True)
class Pieces:
    """An op that cuts the sharded dim into pieces (offsets and sizes along it, one per output)."""

    dim: int
    bounds: tuple[tuple[int, int], ...]
    """``(start, stop)`` of each output along the sharded dim."""


Shapes = dict[int, tuple[int, ...]]

Cuts = dict[int, Cut]


_DUNDER = {"radd": "add", "iadd": "add", "rmul": "mul", "imul": "mul", "rsub": "rsub", "isub": "sub",
           "truediv": "div", "rtruediv": "div", "itruediv": "div", "floordiv": "floor_divide",
           "matmul": "matmul", "rmatmul": "matmul", "getitem": "getitem", "setitem": "setitem",
           "and": "logical_and", "or": "logical_or", "invert": "bitwise_not", "mod": "remainder"}


def base_name(name: str) -> str:
    """``"Tensor.__radd__"`` -> ``"add"``, ``"Tensor.mul_"`` -> ``"mul"``, ``"F.gelu"`` -> ``"gelu"``."""
    base = name.rsplit(".", 1)[-1]
    if base.startswith("__") and base.endswith("__"):
        base = base[2:-2]
        return _DUNDER.get(base, base)
    if base.endswith("_") and not base.startswith("_"):
        base = base[:-1]
    return base



# ------------------------------------------------------------------------------------- helpers
def arg(op: Op, index: int, name: str, default: Any = None) -> Any:
    if len(op.args) > index:
        return op.args[index]
    return op.kwargs.get(name, default)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def single_input(op: Op, sharded: Cuts) -> tuple[int, Cut]:
    """(value id, cut) of the op's first argument, which must be the only cut one."""
    first = op.args[0] if op.args else None
    if not isinstance(first, Ref) or first.id not in sharded or len(sharded) != 1:
        raise Unsupported(f"{op.name}: a sharded value is not its first argument")
    return first.id, sharded[first.id]


def one_output(op: Op, cut: Cut | None) -> Cuts:
    return {} if cut is None else {op.outputs[0]: cut}


def sizes(value: Any) -> tuple[int, ...]:
    """Sizes given as ``f(2, 3)`` or ``f((2, 3))``."""
    if len(value) == 1 and isinstance(value[0], (tuple, list)):
        return tuple(value[0])
    return tuple(value)
