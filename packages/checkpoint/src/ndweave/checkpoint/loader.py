"""``load(path, state)``: read a checkpoint written at any layout into ``state`` at this one.

    reader        the folder's metadata, its files checked against the marker (or a single file)
    destination   what every entry reads into, in this rank's layout (:mod:`.targets`)
    compare       keys and global shapes against the checkpoint, all ranks' findings combined
    read          DCP's load: each rank reads only the chunks overlapping what it holds
    hand over     each entry's load_state_dict (modules first)
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ndweave.mesh.torch_compat import flatten_state_dict

from ndweave.checkpoint.coordination import coordinate, is_distributed
from ndweave.checkpoint.errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from ndweave.checkpoint.pieces import PieceLoadPlanner, PieceSet
from ndweave.checkpoint.readers import open_reader
from ndweave.checkpoint.targets import Destination, destination

__all__ = ["LoadResult", "load", "read_into", "set_path"]


@dataclass
class LoadResult:
    """What a ``strict=False`` load left out (a strict load raises instead): one line per problem,
    the same on every rank."""

    missing: list[str] = field(default_factory=list)
    """In the state, not in the checkpoint (left as it was)."""
    unexpected: list[str] = field(default_factory=list)
    """In the checkpoint, loaded by no rank."""
    mismatched: list[str] = field(default_factory=list)
    """In both, with another global shape or kind (left as it was)."""


def set_path(root: Any, path: tuple, value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, making dicts (and lists, for int keys) on the way."""
    for here, nxt in zip(path, path[1:]):
        if isinstance(root, list):
            root.extend([None] * (here + 1 - len(root)))
            if root[here] is None:
                root[here] = {} if isinstance(nxt, str) else []
        elif here not in root or root[here] is None:
            root[here] = {} if isinstance(nxt, str) else []
        root = root[here]
    if isinstance(root, list):
        root.extend([None] * (path[-1] + 1 - len(root)))
    root[path[-1]] = value


def _compare(flat: dict[str, Any], metadata: Metadata, dest: Destination) -> tuple[list[str], list[str]]:
    """This rank's ``(missing, mismatched)`` lines, flat keys first."""
    missing = [line for kind, line in dest.problems if kind == "missing"]
    mismatched = [line for kind, line in dest.problems if kind == "mismatched"]
    for key, leaf in flat.items():
        md = metadata.state_dict_metadata.get(key)
        is_tensor = isinstance(leaf, (torch.Tensor, PieceSet))
        if md is None:
            missing.append(key)
        elif isinstance(md, TensorStorageMetadata) and is_tensor and md.size != leaf.size():
            mismatched.append(f"{key}: {tuple(md.size)} in the checkpoint, {tuple(leaf.size())} in the state")
        elif isinstance(md, BytesStorageMetadata) and is_tensor:
            mismatched.append(f"{key}: a value in the checkpoint, a tensor of {tuple(leaf.size())} in the state")
        elif isinstance(md, TensorStorageMetadata) and not is_tensor and isinstance(leaf, (dict, list)):
            mismatched.append(f"{key}: a tensor of {tuple(md.size)} in the checkpoint, a container in the state")
    return missing, mismatched


def _unexpected(dest: Destination, everyone: list[dict[str, set[str]]]) -> list[str]:
    lines = []
    for key, saved in dest.saved_fqns.items():
        loaded = set().union(*(fqns.get(key, set()) for fqns in everyone))
        lines += [f"{dest.prefixes[key]}{fqn}" for fqn in sorted(saved - loaded)]
    return lines


def _skip(flat: dict[str, Any], dest: Destination, lines: list[str]) -> None:
    """Leave out of the read every flat key a problem line names (``strict=False``); an optimizer
    parameter with any key left out keeps all of its state (half an Adam state would break a step)."""
    for line in lines:
        key = line.split(":", 1)[0]
        flat.pop(key, None)
        for entry in dest.saved_fqns:
            if key.startswith(f"{entry}.state."):
                dest.skipped.add((entry, key[len(entry) + 7 :].rsplit(".", 1)[0]))
    for entry, fqn in dest.skipped:
        for name in list(flat):
            if name.startswith(f"{entry}.state.{fqn}.") and "." not in name[len(entry) + len(fqn) + 8 :]:
                flat.pop(name)


def read_into(flat: dict[str, Any], reader: Any, path: str, *, collective: bool) -> None:
    """DCP's load of the flat state ``flat`` (tensors and piece sets filled in place, other values
    replaced) from ``reader``; errors as ours (torch's ``CheckpointException`` is a BaseException)."""
    try:
        with warnings.catch_warnings():  # one process without a process group is a supported case
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, storage_reader=reader, planner=PieceLoadPlanner(), no_dist=not collective)
    except CheckpointException as error:  # a BaseException: turn it into an ordinary one
        damaged = [e for e, _ in error.failures.values() if isinstance(e, CorruptCheckpointError)]
        if damaged:
            problems = sorted({p for e in damaged for p in e.problems})
            raise CorruptCheckpointError(path, problems, sorted({f for e in damaged for f in e.files})) from None
        raise CheckpointError(f"loading {path} failed on ranks {sorted(error.failures)}:\n{error}") from None


def load(path: str | os.PathLike, state: dict[str, Any], *, strict: bool = True, key: str | None = None) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` (a collective when there is a process group).

    ``state`` holds the same kinds of entries :func:`save` takes, laid out however this run is: any
    DP or TP size, ZeRO on or off, one process without a process group, a plain ``torch.optim``
    optimizer where a ``DistributedOptimizer`` was saved (or the other way). Models and optimizers
    are loaded through their ``load_state_dict``; plain tensors in place; plain values are replaced
    in ``state``.

    ``path`` is a checkpoint folder, or a single file :func:`export` wrote (a torch file, or
    HF-style safetensors) holding the entry ``key`` (or, for a torch file without ``key``, the whole
    nested state): each rank reads only the slices it needs.

    Args:
        strict: raise :class:`CheckpointMismatchError` naming every key or global shape that differs
            (the same error on every rank). ``False`` loads what matches and returns the rest.
        key: the entry a single-file checkpoint holds (``"model"`` for safetensors by default).

    Returns:
        a :class:`LoadResult`: empty after a strict load.
    """
    path = str(path)
    mine: dict[str, Any] = {}

    def prepare() -> tuple[list[str], list[str], dict[str, set[str]]]:
        mine["reader"] = reader = open_reader(path, key)
        mine["metadata"] = metadata = reader.read_metadata()
        mine["dest"] = dest = destination(state, metadata)
        mine["flat"], mine["paths"] = flatten_state_dict(dest.tree)
        mine["missing"], mine["mismatched"] = _compare(mine["flat"], metadata, dest)
        return mine["missing"], mine["mismatched"], dest.fqns

    def report(everyone: list[tuple[list[str], list[str], dict[str, set[str]]]]) -> list[LoadResult]:
        found = LoadResult(sorted({line for m, _, _ in everyone for line in m}),
                           _unexpected(mine["dest"], [fqns for _, _, fqns in everyone]),
                           sorted({line for _, m, _ in everyone for line in m}))
        return [found] * len(everyone)

    result = coordinate(f"loading {path}", prepare, report)  # the same findings on every rank
    dest, flat = mine["dest"], mine["flat"]
    if strict and (result.missing or result.unexpected or result.mismatched):
        raise CheckpointMismatchError(path, result.missing, result.unexpected, result.mismatched)
    _skip(flat, dest, mine["missing"] + mine["mismatched"])
    tensors = {k for k, v in flat.items() if isinstance(v, (torch.Tensor, PieceSet))}
    read_into(flat, mine["reader"], path, collective=is_distributed())
    for name, value in flat.items():
        if name not in tensors:
            set_path(dest.tree, mine["paths"][name], value)
    dest.hand_over()
    return result
