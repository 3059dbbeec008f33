"""Input plans bound to the forward signature, once, at ``parallelize_module`` time.

An input plan names arguments by position (a list) or by name (a dict); a call may pass any of them
positionally or by keyword. Each plan entry is resolved here to the slot it lands in (a position,
a keyword, or both), so ``m(x)`` and ``m(x=x)`` get the same layout, and an entry naming an argument
``forward`` does not take fails before the first step instead of being skipped on every call.

- list: entry i is the i-th positional parameter; past them, the elements of ``*args``.
- dict: a parameter's name; the ``*args`` name (``"args"``) with a list, one entry per element; the
  ``**kwargs`` name with a dict, or any other name when ``forward`` takes ``**kwargs``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from ndweave.dmodule.spec import PlanKeyError, suggest

__all__ = ["InputSlot", "apply_input_slots", "bind_input_plan", "loose_input_plans"]

# veScale's entry point (``ndweave.dmodule.vescale``) binds input plans as veScale does: entries the
# forward cannot take are dropped with a warning, not refused. Scoped to one call, never process-wide.
_LOOSE: contextvars.ContextVar[bool] = contextvars.ContextVar("ndweave_loose_input_plans", default=False)


@contextlib.contextmanager
def loose_input_plans() -> Iterator[None]:
    """Within it, an input plan entry the forward does not take warns (``UserWarning``) and is dropped,
    as veScale does, instead of raising ``PlanKeyError``."""
    token = _LOOSE.set(True)
    try:
        yield
    finally:
        _LOOSE.reset(token)


def _refuse(message: str) -> None:
    if not _LOOSE.get():
        raise PlanKeyError(message)
    warnings.warn(f"{message.split('; ')[0]}: ignored, as veScale ignores it (ndweave.dmodule.parallelize_module "
                  "refuses it)", UserWarning, stacklevel=2)


@dataclass(frozen=True)
class InputSlot:
    """Where one input plan entry lands in a call."""

    label: str
    """How the plan named it, for logs and errors: ``"0"``, ``"x"``, ``"args[1]"``."""
    index: int | None
    """Its position in ``args`` when passed positionally; ``None`` for keyword-only and ``**kwargs``."""
    name: str | None
    """Its keyword when passed by name; ``None`` for ``*args`` elements and positional-only parameters."""
    tree: Any
    """The normalized plan value (``spec.plan_tree``) laid over the argument."""


def bind_input_plan(module: nn.Module, fqn: str, plan: list | dict) -> list[InputSlot]:
    """The slots of ``plan`` (a module's normalized ``input`` plan) in ``module.forward``'s signature."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin forward: nothing to bind names to
        sig = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    where = f"forward plan {fqn or '<root>'}.input"
    takes = f"{type(module).__name__}.forward{sig}"

    def keyword(p: inspect.Parameter) -> str | None:
        return None if p.kind is p.POSITIONAL_ONLY else p.name

    slots = []
    if isinstance(plan, list):
        if len(plan) > len(positional) and var_pos is None:
            _refuse(f"{where} gives {len(plan)} inputs but {takes} takes {len(positional)} positional "
                    f"argument(s); drop the extra entries, or name keyword arguments in a dict plan")
            plan = plan[:len(positional)]
        for i, tree in enumerate(plan):
            name = keyword(positional[i]) if i < len(positional) else None
            slots.append(InputSlot(str(i), i, name, tree))
        return slots
    by_name = {p.name: p for p in params}
    for name, tree in plan.items():
        p = by_name.get(name)
        if p is None:
            if var_kw is None:
                _refuse(f"{where} names {name!r}, which {takes} does not take"
                        f"{suggest(name, [q.name for q in params])}; rename or remove it")
                continue
            slots.append(InputSlot(name, None, name, tree))  # one of **kwargs
        elif p.kind is p.VAR_POSITIONAL:
            _expect(isinstance(tree, list), where, name, "a list: one entry per element of *args")
            slots += [InputSlot(f"{name}[{j}]", len(positional) + j, None, t) for j, t in enumerate(tree)]
        elif p.kind is p.VAR_KEYWORD:
            _expect(isinstance(tree, dict), where, name, "a dict: one entry per keyword of **kwargs")
            slots += [InputSlot(k, None, k, t) for k, t in tree.items()]
        else:
            index = positional.index(p) if p in positional else None
            slots.append(InputSlot(name, index, keyword(p), tree))
    return slots


def _expect(ok: bool, where: str, name: str, what: str) -> None:
    if not ok:
        raise TypeError(f"{where}[{name!r}] plans the variadic argument {name!r}: give {what}")


def apply_input_slots(slots: list[InputSlot], args: tuple, kwargs: dict,
                      lay: Callable[[Any, Any, str], Any]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each slot's argument replaced by ``lay(argument, tree, label)``, wherever
    the call put it (positionally or by keyword); arguments the call left out stay out."""
    args = list(args)
    for slot in slots:
        if slot.index is not None and slot.index < len(args):
            args[slot.index] = lay(args[slot.index], slot.tree, slot.label)
        elif slot.name is not None and slot.name in kwargs:
            kwargs[slot.name] = lay(kwargs[slot.name], slot.tree, slot.label)
    return tuple(args), kwargs
