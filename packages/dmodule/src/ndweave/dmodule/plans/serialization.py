"""Plans as JSON: ``save_plan(plan, path)`` / ``load_plan(path_or_file)``.

Encoding (every placement or spec is a one-key object, so argument-name dicts stay unambiguous)::

    Replicate()                          "Replicate"
    Shard(0)                             {"Shard": 0}
    Partial("sum")                       {"Partial": "sum"}
    _StridedShard(1, split_factor=3)     {"StridedShard": [1, 3]}
    PlacementSpec([Shard(-1)], to_local=True)
                                         {"PlacementSpec": {"placements": [{"Shard": -1}], "to_local": true}}
        (options at their defaults are left out: "async_op": false, "grad_placements": null, "to_local": false)

Lists, ``None`` and dicts keyed by argument name are kept as they are. Patches must be named (a
name registered with ``register_patch``, or ``{"name": ..., "args": {...}}`` with JSON arguments): a
callable cannot be written to JSON.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ndweave.dmodule.spec import SECTIONS, PlacementSpec
from ndweave.mesh.torch_compat import StridedShard

__all__ = ["save_plan", "load_plan", "encode_plan", "decode_plan"]

_FORMAT = 1


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, StridedShard):
        return {"StridedShard": [value.dim, value.split_factor]}
    if isinstance(value, Shard):
        return {"Shard": value.dim}
    if isinstance(value, Replicate):
        return "Replicate"
    if isinstance(value, Partial):
        return {"Partial": value.reduce_op}
    if isinstance(value, PlacementSpec):
        spec: dict[str, Any] = {"placements": _encode(list(value.placements), where)}
        if value.async_op:  # options at their defaults are left out
            spec["async_op"] = True
        if value.grad_placements is not None:
            spec["grad_placements"] = _encode(list(value.grad_placements), where)
        if value.to_local:
            spec["to_local"] = True
        return {"PlacementSpec": spec}
    if isinstance(value, Placement):
        raise TypeError(f"{where}: placement {value!r} has no JSON encoding")
    if isinstance(value, (list, tuple)):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v, where) for k, v in value.items()}
    raise TypeError(f"{where}: {value!r} ({type(value).__name__}) has no JSON encoding")


_FORMS = ('"Replicate", {"Shard": dim}, {"Partial": "sum"}, {"StridedShard": [dim, split_factor]}, '
          '{"PlacementSpec": {"placements": [...], ...}}, null (leave it alone), or a list / dict of these')


_TAGS = ("Shard", "Partial", "StridedShard", "PlacementSpec")


def _decode(value: Any, where: str) -> Any:
    if value is None or value == "Replicate":
        return None if value is None else Replicate()
    if isinstance(value, list):
        return [_decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if len(value) == 1 and next(iter(value)) in _TAGS:
            (tag, arg), = value.items()
            try:
                return _decode_tagged(tag, arg, where)
            except (TypeError, ValueError, KeyError, IndexError) as error:
                raise ValueError(f"{where}: {json.dumps(value)} is not a valid placement ({error}); valid forms: "
                                 f"{_FORMS}") from None
        return {k: _decode(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise ValueError(f"{where}: {json.dumps(value)} is not a placement; valid forms: {_FORMS}")


def _decode_tagged(tag: str, arg: Any, where: str) -> Any:
    """A one-key object naming a placement or spec by its tag."""
    if tag == "Shard":
        return Shard(_integer(arg))
    if tag == "Partial":
        if not isinstance(arg, str):
            raise TypeError("Partial takes a reduce op name such as \"sum\"")
        return Partial(arg)
    if tag == "StridedShard":
        dim, split_factor = arg
        return StridedShard(_integer(dim), split_factor=_integer(split_factor))
    if tag == "PlacementSpec":
        unknown = set(arg) - {"placements", "async_op", "grad_placements", "to_local"}
        if unknown:
            raise KeyError(f"unknown PlacementSpec options {sorted(unknown)}")
        grad = arg.get("grad_placements")
        return PlacementSpec(
            _decode(arg["placements"], where),
            async_op=bool(arg.get("async_op", False)),
            grad_placements=None if grad is None else _decode(grad, where),
            to_local=bool(arg.get("to_local", False)),
        )
    raise KeyError(tag)


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{json.dumps(value)} is not an integer")
    return value


def encode_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` as plain JSON data (see the module docstring for the encoding)."""
    unknown = set(plan) - set(SECTIONS)
    if unknown:
        raise ValueError(f"a sharding plan has the sections {list(SECTIONS)}, not {sorted(unknown)}")
    out: dict[str, Any] = {"ndweave_plan_format": _FORMAT}
    for section in ("parameter", "forward"):
        if section in plan:
            out[section] = {key: _encode(value, f"{section}[{key!r}]") for key, value in plan[section].items()}
    if "patch" in plan:
        out["patch"] = {}
        for key, patches in plan["patch"].items():
            patches = [patches] if isinstance(patches, (str, dict)) or callable(patches) else list(patches)
            for p in patches:
                if callable(p):
                    raise TypeError(
                        f"patch[{key!r}]: {p!r} is a callable; JSON plans name their patches: register it with "
                        "ndweave.dmodule.register_patch and use its name"
                    )
            out["patch"][key] = _patch_entries(key, patches, TypeError)
    return out


def _patch_entries(key: str, patches: Any, error: type[Exception]) -> list[Any]:
    """``patches`` if it is a list of patch names and ``{"name": ..., "args": {...}}`` entries whose
    arguments are JSON, else ``error`` naming the entry."""
    def valid(p: Any) -> bool:
        if isinstance(p, str):
            return True
        if not (isinstance(p, dict) and isinstance(p.get("name"), str) and set(p) <= {"name", "args"}
                and isinstance(p.get("args", {}), dict)):
            return False
        try:
            json.dumps(p)
        except (TypeError, ValueError):
            return False
        return True

    if not isinstance(patches, list) or not all(map(valid, patches)):
        raise error(f"patch[{key!r}]: {patches!r} is not a patch name, a {{\"name\": ..., \"args\": {{...}}}} "
                    "entry with JSON arguments, or a list of them (names registered with "
                    "ndweave.dmodule.register_patch)")
    return patches


def decode_plan(data: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode_plan`."""
    data = dict(data)
    version = data.pop("ndweave_plan_format", _FORMAT)
    if version != _FORMAT:
        raise ValueError(f"plan format {version} is not supported (this version reads {_FORMAT})")
    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise ValueError(f"a sharding plan has the sections {list(SECTIONS)}, not {sorted(unknown)}")
    plan: dict[str, Any] = {}
    for section in ("parameter", "forward"):
        if section in data:
            if not isinstance(data[section], dict):
                raise ValueError(f"section {section!r} is {json.dumps(data[section])}; it maps plan keys to values")
            plan[section] = {key: _decode(value, f"{section}[{key!r}]") for key, value in data[section].items()}
    if "patch" in data:
        plan["patch"] = {}
        for key, patches in data["patch"].items():
            patches = [patches] if isinstance(patches, (str, dict)) else patches
            plan["patch"][key] = _patch_entries(key, patches, ValueError)
    return plan


def _format(data: dict[str, Any]) -> str:
    """JSON with one plan entry per line: diffable, and readable by people who edit plans."""
    lines = ["{", f'  "ndweave_plan_format": {json.dumps(data["ndweave_plan_format"])}']
    for section in SECTIONS:
        if section in data:
            entries = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in data[section].items()]
            body = ("{\n" + ",\n".join(entries) + "\n  }") if entries else "{}"
            lines[-1] += ","
            lines.append(f'  "{section}": {body}')
    return "\n".join(lines) + "\n}\n"


def save_plan(plan: dict[str, Any], path: str | os.PathLike | IO[str]) -> None:
    """Write ``plan`` (a ``sharding_plan`` dict) as JSON to a path or an open text file."""
    text = _format(encode_plan(plan))
    if hasattr(path, "write"):
        path.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)


def load_plan(path_or_file: str | os.PathLike | IO[str]) -> dict[str, Any]:
    """Read a plan written by :func:`save_plan` (or by hand in the same encoding).

    Errors name the file and the line: invalid JSON where the parser stopped, a value that is not a
    placement at its entry's line, with the valid forms."""
    if hasattr(path_or_file, "read"):
        text, name = path_or_file.read(), getattr(path_or_file, "name", "<file>")
    else:
        with open(path_or_file) as f:
            text, name = f.read(), os.fspath(path_or_file)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"plan file {name}, line {error.lineno} column {error.colno}: not valid JSON "
                         f"({error.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"plan file {name}: a JSON plan is an object with sections {list(SECTIONS)}, "
                         f"got {type(data).__name__}")
    try:
        return decode_plan(data)
    except (TypeError, ValueError) as error:
        raise ValueError(f"plan file {name}{_line_of(text, data, str(error))}: {error}") from None


def _line_of(text: str, data: dict[str, Any], message: str) -> str:
    """``", line N"`` for the plan entry the error names (``section['key']...``), or ``""``."""
    for section in SECTIONS:
        for key in data.get(section) or {}:
            if message.startswith(f"{section}[{key!r}]"):
                for number, line in enumerate(text.splitlines(), 1):
                    if line.lstrip().startswith(json.dumps(key)):
                        return f", line {number}"
    return ""
