"""``explain_plan(model, plan)``: each plan entry with the pattern behind it, what stays replicated
and why, and the parameter bytes each rank holds.

    from ndweave.dmodule.plans import explain_plan, get_plan

    print(explain_plan(model, get_plan("auto", model), tp_size=4))

The reasons come from deriving the automatic plan for the same model: an entry equal to what
"auto" writes gets its pattern; one that differs (a plan edited by hand, a zoo plan) says what
"auto" would write there and why; a key matching no module says so.
"""

from __future__ import annotations

import math
import re
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard

from ndweave.dmodule.experts.parallel import EXPERT_PATCH
from ndweave.dmodule.infer.auto import derive
from ndweave.dmodule.patches import patch_name
from ndweave.dmodule.plan import match_modules
from ndweave.dmodule.spec import split_key
from ndweave.mesh.torch_compat import StridedShard

__all__ = ["explain_plan"]

_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")  # a layer index: one reason for all the layers


def _looks_sequence_parallel(plan: dict[str, Any]) -> bool:
    return any(repr([Shard(1)]) in repr(v) for v in (plan.get("forward") or {}).values())


def _looks_loss_parallel(plan: dict[str, Any]) -> bool:
    return any(k.endswith(".output") and v == [[Shard(-1)]] for k, v in (plan.get("forward") or {}).items())


def _looks_expert_parallel(plan: dict[str, Any]) -> bool:
    return any(patch_name(e) == EXPERT_PATCH for entries in (plan.get("patch") or {}).values() for e in entries)


def _local_numel(shape: tuple[int, ...], placements: list, tp: int) -> int:
    """Elements of the largest shard (rank 0's) under ``placements`` on a 1-D mesh of ``tp`` ranks."""
    shape = list(shape)
    for p in placements:
        if isinstance(p, (Shard, StridedShard)):
            shape[p.dim] = math.ceil(shape[p.dim] / tp)
    return math.prod(shape)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def explain_plan(model: nn.Module, plan: dict[str, Any] | None = None, *, tp_size: int = 2,
                 sequence_parallel: bool | None = None, loss_parallel: bool | None = None,
                 example_inputs: tuple[tuple, dict] | None = None) -> str:
    """A report on ``plan`` (default: the automatic one) for ``model`` on ``tp_size`` ranks: per key
    its value, the modules it matches, why (the pattern), and the bytes per rank of the parameters
    it lays out; then what stays replicated and why; then the totals. ``sequence_parallel`` /
    ``loss_parallel``: the flags to derive "auto" with (default: read from the plan); a plan with an
    ``expert_parallel`` patch is compared with "auto"'s expert-parallel derivation."""
    given = plan is not None
    sp = _looks_sequence_parallel(plan) if sequence_parallel is None and given else bool(sequence_parallel)
    lp = _looks_loss_parallel(plan) if loss_parallel is None and given else bool(loss_parallel)
    ep = given and _looks_expert_parallel(plan)
    derived = derive(model, sequence_parallel=sp, loss_parallel=lp, expert_parallel=ep, example_inputs=example_inputs)
    plan = plan if given else derived.plan()
    auto = {(e.section, e.module, e.leaf): e for e in derived.entries.items if e.section != "patch"}
    params = dict(model.named_parameters(remove_duplicate=False))
    lines = [f"{'given' if given else 'automatic'} plan for {type(model).__name__} on {tp_size} tensor-parallel ranks "
             f"(sequence_parallel={sp}, loss_parallel={lp}, expert_parallel={ep}; derived in {derived.seconds:.2f} s)"]
    planned: dict[str, list] = {}
    for section in ("parameter", "forward"):
        for key, value in (plan.get(section) or {}).items():
            regex, leaf = split_key(key)
            modules = [fqn for fqn, _ in match_modules(model, regex, key)]
            lines.append(f"{section}[{key!r}] = {value!r}  ({len(modules)} module{'s' * (len(modules) != 1)})")
            lines.append(f"    why: {_why(auto, section, modules, leaf, value)}")
            if section == "parameter":
                names = [n for n in (f"{m}.{leaf}" if m else leaf for m in modules) if n in params]
                for name in names:
                    planned[name] = value
                full = sum(params[n].numel() * params[n].element_size() for n in names)
                local = sum(_local_numel(tuple(params[n].shape), value, tp_size) * params[n].element_size()
                            for n in names)
                lines.append(f"    bytes per rank: {_bytes(local)} of {_bytes(full)}")
    patches = {(e.module, patch_name(e.value)): e.why for e in derived.entries.items if e.section == "patch"}
    for key, entries in (plan.get("patch") or {}).items():
        lines.append(f"patch[{key!r}] = {entries!r}")
        modules = [fqn for fqn, _ in match_modules(model, key)] if not key.startswith("class:") else []
        whys = dict.fromkeys(_NUMBER.sub("N", patches[m, patch_name(e)]) for e in entries for m in modules
                             if (m, patch_name(e)) in patches)
        if whys:
            lines.append(f"    why: {'; '.join(whys)}")
    lines.append("replicated:" if derived.replicated else "replicated: nothing the planner could shard")
    lines += [f"    {line}" for line in derived.replicated]
    seen: dict[int, str] = {}
    for name, p in params.items():
        seen.setdefault(id(p), name)
    unique = [(name, params[name]) for name in seen.values()]
    full = sum(p.numel() * p.element_size() for _, p in unique)
    local = sum(_local_numel(tuple(p.shape), planned.get(name, []), tp_size) * p.element_size() for name, p in unique)
    lines.append(f"parameters per rank: {_bytes(local)} of {_bytes(full)} ({100 * local / max(full, 1):.0f}%)")
    return "\n".join(lines)


def _why(auto: dict, section: str, modules: list[str], leaf: str, value: Any) -> str:
    if not modules:
        return "matches no module of this model"
    reasons = []
    for module in modules:
        entry = auto.get((section, module, leaf))
        if entry is None:
            reasons.append(f"not from auto (auto leaves {module or '<root>'}.{leaf} as it is)")
        elif entry.value != value:
            reasons.append(f"not from auto (auto writes {entry.value!r} for {module or '<root>'}.{leaf}: {entry.why})")
        else:
            reasons.append(entry.why)
    return "; ".join(dict.fromkeys(_NUMBER.sub("N", r) for r in reasons))
