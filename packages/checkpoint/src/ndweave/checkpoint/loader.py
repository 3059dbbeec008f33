"""``load(path, state)``: read a checkpoint written at any layout into ``state`` at this one.

One DCP load, whose planner does the work on every rank, where DCP reports any rank's error to all::

    metadata      the reader's (read first): the folder's files checked against the marker
    destination   what every entry reads into, in this rank's layout (:mod:`.targets`)
    compare       keys and global shapes against the checkpoint; rank 0 combines every rank's
                  findings in the global plan (a strict load raises there) and sends them back
    read          each rank reads only the chunks overlapping what it holds
    hand over     each entry's load_state_dict (modules first)
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from ndweave.mesh.torch_compat import flatten_state_dict

from ndweave.checkpoint.coordination import is_distributed
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
    """Leave out of the read every flat key a problem line names (what a partial load skips; a strict
    one raises before reading); an optimizer parameter with any key left out keeps all of its state
    (half an Adam state would break the next step)."""
    optimizers = [entry for entry, prefix in dest.prefixes.items() if prefix == f"{entry}.state."]
    for line in lines:
        key = line.split(":", 1)[0]
        flat.pop(key, None)
        for entry in optimizers:
            if key.startswith(f"{entry}.state."):
                dest.skipped.add((entry, key[len(entry) + 7 :].rsplit(".", 1)[0]))
    for entry, fqn in dest.skipped:
        for name in list(flat):
            if name.startswith(f"{entry}.state.{fqn}.") and "." not in name[len(entry) + len(fqn) + 8 :]:
                flat.pop(name)


def read_into(flat: dict[str, Any], reader: Any, path: str, *, collective: bool,
              planner: PieceLoadPlanner | None = None) -> None:
    """DCP's load of the flat state ``flat`` (tensors and piece sets filled in place, other values
    replaced) from ``reader``; errors as ours (torch's ``CheckpointException`` is a BaseException),
    the same on every rank."""
    try:
        with warnings.catch_warnings():  # one process without a process group is a supported case
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, storage_reader=reader, planner=planner or PieceLoadPlanner(), no_dist=not collective)
    except CheckpointException as error:
        failures = {r: e for r, (e, _) in error.failures.items()}
        first = failures[min(failures)]
        if isinstance(first, CheckpointMismatchError):
            raise first from None
        damaged = [e for e in failures.values() if isinstance(e, CorruptCheckpointError)]
        if damaged:
            problems = sorted({p for e in damaged for p in e.problems})
            raise CorruptCheckpointError(path, problems, sorted({f for e in damaged for f in e.files})) from None
        if isinstance(first, CheckpointError):
            raise first from None
        raise CheckpointError(f"loading {path} failed on ranks {sorted(failures)}:\n{error}") from None


class _StatePlanner(PieceLoadPlanner):
    """Plans the load of a user's ``state``: builds the destination from the checkpoint's metadata,
    compares, and (rank 0, in the global plan) combines every rank's findings."""

    def __init__(self, state: dict[str, Any], path: str, strict: bool) -> None:
        super().__init__()
        self.state, self.path, self.strict = state, path, strict
        self.result = LoadResult()

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        self.dest = destination(self.state, metadata)
        self.flat, self.paths = flatten_state_dict(self.dest.tree)
        self.problems = _compare(self.flat, metadata, self.dest)
        _skip(self.flat, self.dest, self.problems[0] + self.problems[1])  # a strict load raises below
        self.tensors = {k for k, v in self.flat.items() if isinstance(v, (torch.Tensor, PieceSet))}
        super().set_up_planner(self.flat, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        return dataclasses.replace(plan, planner_data=(*self.problems, self.dest.fqns))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        found = [p.planner_data for p in global_plan]
        result = LoadResult(sorted({line for m, _, _ in found for line in m}),
                            _unexpected(self.dest, [fqns for _, _, fqns in found]),
                            sorted({line for _, m, _ in found for line in m}))
        if self.strict and (result.missing or result.unexpected or result.mismatched):
            raise CheckpointMismatchError(self.path, result.missing, result.unexpected, result.mismatched)
        return [dataclasses.replace(p, planner_data=result) for p in super().create_global_plan(global_plan)]

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        self.result = new_plan.planner_data
        return super().finish_plan(new_plan)


def load(path: str | os.PathLike, state: dict[str, Any], *, strict: bool = True, key: str | None = None,
         aliases: dict[str, str] | None = None) -> LoadResult:
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
        aliases: ``{name: stored_name}`` (names inside the entry) for a tensor a single file stores once
            under another name: transformers saves a tied LM head only as its embedding, so
            ``load("llama-dir", {"model": model}, aliases={"lm_head.weight": "model.embed_tokens.weight"})``.

    Returns:
        a :class:`LoadResult`: empty after a strict load.
    """
    path = str(path)
    reader = open_reader(path, key, aliases)
    # read (and check) here, not inside DCP's load: DCP turns a failing read_metadata into a bare
    # AssertionError. Every rank sees the same shared files, so every rank raises the same error.
    reader.read_metadata()
    planner = _StatePlanner(state, path, strict)
    read_into({}, reader, path, collective=is_distributed(), planner=planner)
    for name, value in planner.flat.items():
        if name not in planner.tensors:  # values DCP replaced in the flat dict go back into the tree
            set_path(planner.dest.tree, planner.paths[name], value)
    planner.dest.hand_over()
    return planner.result
