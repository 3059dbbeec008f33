"""Plan entries with the reason each was written, and the plan dict they make.

The planner writes one entry per module (``model.layers.3.mlp.down_proj.weight``); :meth:`Entries.plan`
folds entries that agree across every numbered copy of a module (``model.layers.\\d+.mlp.down_proj``)
into one regex key, the way the zoo's plans are written, so a saved plan stays short and readable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Entries", "Entry"]

_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")  # a whole dotted component that is a number


@dataclass(frozen=True)
class Entry:
    """One plan entry and why the planner wrote it."""

    section: str
    """``"parameter"``, ``"forward"`` or ``"patch"``."""
    module: str
    """FQN of the module it is about."""
    leaf: str
    """Parameter / buffer name, ``"input"`` / ``"output"``, or ``""`` for a patch."""
    value: Any
    """Placements, a forward value, or a patch entry (name or ``{"name", "args"}``)."""
    why: str
    """The pattern that made it."""


@dataclass
class Entries:
    """The entries of one plan, in the order written."""

    items: list[Entry] = field(default_factory=list)

    def add(self, section: str, module: str, leaf: str, value: Any, why: str) -> None:
        for i, e in enumerate(self.items):
            if (e.section, e.module, e.leaf) == (section, module, leaf) and section != "patch":
                if e.value == value:
                    return
                merged = _merged(e.value, value)
                if merged is None:
                    raise ValueError(f"{section} {module}.{leaf}: two patterns disagree ({e.why}: {e.value}; "
                                     f"{why}: {value})")
                self.items[i] = Entry(section, module, leaf, merged, e.why if e.why == why else f"{e.why}; {why}")
                return
        self.items.append(Entry(section, module, leaf, value, why))

    aliases: dict[str, list[str]] = field(default_factory=dict)
    """Parameter FQN -> every FQN of it (tied weights): an entry for one is written for each."""
    context: Any = None
    """What the emitters share (the trace's boundaries and the traced copy), set by the first one."""
    whole_tables: list[str] = field(default_factory=list)
    """Embedding tables a lookup needs whole (not vocab-parallel): one placement for every use."""

    def get(self, section: str, module: str, leaf: str) -> Entry | None:
        return next((e for e in self.items if (e.section, e.module, e.leaf) == (section, module, leaf)), None)

    def param(self, fqn: str, placements: list, why: str) -> None:
        for name in self.aliases.get(fqn, [fqn]):
            module, _, leaf = name.rpartition(".")
            self.add("parameter", module, leaf, placements, why)

    def plan(self, modules: list[str]) -> dict[str, Any]:
        """The plan dict, with numbered copies folded into ``\\d+`` keys where every copy agrees."""
        plan: dict[str, dict[str, Any]] = {"parameter": {}, "forward": {}, "patch": {}}
        for section in plan:
            items = [e for e in self.items if e.section == section]
            for key, value in _fold(items, modules, section):
                if section == "patch":
                    plan[section].setdefault(key, []).append(value)
                else:
                    plan[section][key] = value
        return plan


def _merged(first: Any, second: Any) -> Any:
    """Two input plans for different arguments of one module (joint attention's two streams, each the
    input of its own column-wise linears) as one, or ``None`` where they lay out one argument twice."""
    if isinstance(first, dict) and isinstance(second, dict):
        same = all(first[k] == second[k] for k in first.keys() & second.keys())
        return {**first, **second} if same else None
    if isinstance(first, list) and isinstance(second, list):
        merged = [a if b is None or a == b else b if a is None else ... for a, b in zip(first, second)]
        longer = first if len(first) > len(second) else second
        merged += longer[len(merged):]
        return None if ... in merged else merged
    return None


def _pattern(fqn: str) -> str:
    return _NUMBER.sub(r"\\d+", fqn)


def _fold(items: list[Entry], modules: list[str], section: str) -> list[tuple[str, Any]]:
    """(key, value) pairs: one regex key for a group of numbered copies that all hold the same
    value, exact FQN keys otherwise. Keys keep the order of their first entry."""
    groups: dict[tuple[str, str, str], list[Entry]] = {}
    for e in items:
        groups.setdefault((_pattern(e.module), e.leaf, repr(e.value)), []).append(e)
    by_pattern: dict[tuple[str, str], int] = {}  # values per key; a patch key holds several
    for pattern, leaf, value in groups:
        key = (pattern, value) if section == "patch" else (pattern, leaf)
        by_pattern[key] = by_pattern.get(key, 0) + 1
    out: list[tuple[str, Any]] = []
    for (pattern, leaf, _), group in groups.items():
        named = {e.module for e in group}
        matching = {m for m in modules if re.fullmatch(pattern, m)}
        key = (pattern, repr(group[0].value)) if section == "patch" else (pattern, leaf)
        fold = pattern != group[0].module and by_pattern[key] == 1 and named == matching
        keys = [pattern] if fold else sorted(named, key=[e.module for e in group].index)
        for module in keys:
            out.append((module if section == "patch" else f"{module}.{leaf}", group[0].value))
    return out
