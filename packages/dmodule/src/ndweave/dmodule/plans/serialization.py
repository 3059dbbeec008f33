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
string key of ``BUILTIN_PATCHES``): a callable cannot be written to JSON.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ndweave.mesh.torch_compat import StridedShard

__all__ = ["save_plan", "load_plan", "encode_plan", "decode_plan"]

_FORMAT = 1
_SECTIONS = ("parameter", "forward", "patch")


def _encode(value: Any, where: str) -> Any:
    from ndweave.dmodule import PlacementSpec

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


def _decode(value: Any, where: str) -> Any:
    if value == "Replicate":
        return Replicate()
    if isinstance(value, list):
        return [_decode(v, where) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, arg), = value.items()
            if tag == "Shard":
                return Shard(int(arg))
            if tag == "Partial":
                return Partial(arg)
            if tag == "StridedShard":
                return StridedShard(int(arg[0]), split_factor=int(arg[1]))
            if tag == "PlacementSpec":
                from ndweave.dmodule import PlacementSpec

                grad = arg.get("grad_placements")
                return PlacementSpec(
                    _decode(arg["placements"], where),
                    async_op=bool(arg.get("async_op", False)),
                    grad_placements=None if grad is None else _decode(grad, where),
                    to_local=bool(arg.get("to_local", False)),
                )
        return {k: _decode(v, where) for k, v in value.items()}
    return value


def encode_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` as plain JSON data (see the module docstring for the encoding)."""
    unknown = set(plan) - set(_SECTIONS)
    if unknown:
        raise ValueError(f"a sharding plan has the sections {list(_SECTIONS)}, not {sorted(unknown)}")
    out: dict[str, Any] = {"ndweave_plan_format": _FORMAT}
    for section in ("parameter", "forward"):
        if section in plan:
            out[section] = {key: _encode(value, f"{section}[{key!r}]") for key, value in plan[section].items()}
    if "patch" in plan:
        out["patch"] = {}
        for key, patches in plan["patch"].items():
            patches = [patches] if isinstance(patches, str) or callable(patches) else list(patches)
            for p in patches:
                if not isinstance(p, str):
                    raise TypeError(
                        f"patch[{key!r}]: {p!r} is a callable; JSON plans name their patches: register it in "
                        "ndweave.dmodule.plans.BUILTIN_PATCHES and use its name"
                    )
            out["patch"][key] = patches
    return out


def decode_plan(data: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode_plan`."""
    data = dict(data)
    version = data.pop("ndweave_plan_format", _FORMAT)
    if version != _FORMAT:
        raise ValueError(f"plan format {version} is not supported (this version reads {_FORMAT})")
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise ValueError(f"a sharding plan has the sections {list(_SECTIONS)}, not {sorted(unknown)}")
    plan: dict[str, Any] = {}
    for section in ("parameter", "forward"):
        if section in data:
            plan[section] = {key: _decode(value, f"{section}[{key!r}]") for key, value in data[section].items()}
    if "patch" in data:
        plan["patch"] = {key: [patches] if isinstance(patches, str) else list(patches)
                         for key, patches in data["patch"].items()}
    return plan


def _format(data: dict[str, Any]) -> str:
    """JSON with one plan entry per line: diffable, and readable by people who edit plans."""
    lines = ["{", f'  "ndweave_plan_format": {json.dumps(data["ndweave_plan_format"])}']
    for section in _SECTIONS:
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
    """Read a plan written by :func:`save_plan` (or by hand in the same encoding)."""
    if hasattr(path_or_file, "read"):
        data = json.loads(path_or_file.read())
    else:
        with open(path_or_file) as f:
            data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON plan is an object with sections {list(_SECTIONS)}, got {type(data).__name__}")
    return decode_plan(data)
