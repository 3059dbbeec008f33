"""Where a load reads from: an ndweave (or plain DCP) checkpoint folder, one torch file, or
HF-style safetensors. Each is a DCP ``StorageReader``, so the same planner reshards from any of them
into any layout, and each rank reads only the parts it needs: DCP's chunks from a folder, slices of a
memory-mapped torch file, slices of safetensors files.

A single file holds one entry's state dict (an exported model) when it is read with ``key``, else
the whole nested state (``export(..., key=None)``). ``aliases`` (``{name: stored_name}``, names inside
the entry) read a tensor the file stores once under another name: transformers saves a tied LM head
only as the embedding it shares.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, StorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ndweave.mesh.torch_compat import flatten_state_dict

from ndweave.checkpoint.commit import check_files, is_partial, read_marker
from ndweave.checkpoint.errors import CheckpointError, CorruptCheckpointError

__all__ = ["FolderReader", "SafetensorsReader", "TorchFileReader", "open_reader"]

SAFETENSORS_INDEX = "model.safetensors.index.json"


class FolderReader(FileSystemReader):
    """DCP's file-system reader with the metadata read once and checked (the marker's file sizes,
    else the extents DCP's metadata records) and every unreadable file named in one
    :class:`CorruptCheckpointError`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = self._checked_metadata(Path(self.path))
        return self._metadata

    def _checked_metadata(self, folder: Path) -> Metadata:
        if is_partial(folder.name):
            raise CheckpointError(f"{folder} is an uncommitted save (a .partial folder): it is never loaded")
        if not folder.is_dir():
            raise CheckpointError(f"no checkpoint at {folder}")
        marker = read_marker(folder)
        if marker is None and not (folder / ".metadata").is_file():
            raise CheckpointError(f"{folder} is not a checkpoint: it has neither the completion marker of an "
                                  "ndweave save nor the .metadata of a DCP one")
        if marker is not None:
            check_files(folder)
        try:
            metadata = super().read_metadata()
        except Exception as error:
            raise CorruptCheckpointError(str(folder), [f".metadata: unreadable ({error!r})"], [".metadata"]) from error
        if marker is None:
            check_files(folder, metadata)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        problems = []
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as error:  # noqa: BLE001 - every damaged file is named below
                problems.append((name, error))
        if problems:
            raise CorruptCheckpointError(str(self.path), [f"{n}: unreadable ({e!r})" for n, e in problems],
                                         [n for n, _ in problems])
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class _SingleSource(StorageReader):
    """A reader over named whole tensors and values; subclasses open the source (on the first
    ``read_metadata``) and say how to get a slice of each."""

    def __init__(self, path: str | os.PathLike, key: str | None = None,
                 aliases: dict[str, str] | None = None) -> None:
        super().__init__()
        self.path, self.key = Path(path), key
        self.aliases = dict(aliases or {})
        self._metadata: Metadata | None = None
        self._stored: dict[str, str] = {}  # flat key of an alias -> the flat key the file stores it under

    def open(self) -> tuple[dict[str, Any], dict[str, tuple]]:
        """``(shapes, paths)``: per flat key, ``(shape, dtype)`` of a tensor or any other value, and
        its path in the nested state (DCP's planner data)."""
        raise NotImplementedError

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            shapes, paths = self.open()
            self._add_aliases(shapes, paths)
            md = {}
            for name, value in shapes.items():
                if isinstance(value, tuple):  # (shape, dtype) of a tensor: one chunk, all of it
                    size = torch.Size(value[0])
                    md[name] = TensorStorageMetadata(properties=TensorProperties(dtype=value[1]), size=size,
                                                     chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)),
                                                                                  sizes=size)])
                else:
                    md[name] = BytesStorageMetadata()
            self._metadata = Metadata(state_dict_metadata=md, planner_data=paths)
        return self._metadata

    def _add_aliases(self, shapes: dict[str, Any], paths: dict[str, tuple]) -> None:
        """Each alias the file lacks, as a second name of the tensor it stores (a stored name that
        is not in the file either is named in one error)."""
        prefix = f"{self.key}." if self.key else ""
        absent = sorted(s for a, s in self.aliases.items() if prefix + a not in shapes and prefix + s not in shapes)
        if absent:
            raise CheckpointError(f"{self.path} holds neither the aliased names nor {absent}, which aliases= names "
                                  "as where they are stored")
        for alias, stored in self.aliases.items():
            if prefix + alias not in shapes:
                shapes[prefix + alias] = shapes[prefix + stored]
                paths[prefix + alias] = (self.key, alias) if self.key else (alias,)
                self._stored[prefix + alias] = prefix + stored

    def slice(self, name: str, offsets, lengths) -> torch.Tensor:
        raise NotImplementedError

    def value(self, name: str) -> Any:
        raise NotImplementedError

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            name = self._stored.get(item.storage_index.fqn, item.storage_index.fqn)
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(self.value(name), buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            target = planner.resolve_tensor(item).detach()
            target.copy_(self.slice(name, item.storage_offsets, item.lengths))
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return Path(checkpoint_id).exists()


class TorchFileReader(_SingleSource):
    """One ``torch.save`` file, memory-mapped: a rank copies only the slices it needs, so only
    those pages are read."""

    def open(self) -> tuple[dict[str, Any], dict[str, tuple]]:
        try:
            obj = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError) as error:
            raise CorruptCheckpointError(str(self.path), [f"{self.path.name}: unreadable as a torch file ({error!r})"],
                                         [self.path.name]) from error
        self.flat, paths = flatten_state_dict({self.key: obj} if self.key else obj)
        return {n: (v.shape, v.dtype) if isinstance(v, torch.Tensor) else v for n, v in self.flat.items()}, paths

    def slice(self, name: str, offsets, lengths) -> torch.Tensor:
        return _narrow(self.flat[name], offsets, lengths)

    def value(self, name: str) -> Any:
        return self.flat[name]


def _safetensors_dtype(name: str) -> torch.dtype:
    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
    if name not in table:
        raise CheckpointError(f"safetensors dtype {name} is not supported here")
    return table[name]


class SafetensorsReader(_SingleSource):
    """HF-style safetensors: one ``.safetensors`` file, or a folder (or its index file) with
    ``model.safetensors.index.json`` naming each tensor's shard. Holds one entry (``key``)."""

    def open(self) -> tuple[dict[str, Any], dict[str, tuple]]:
        from safetensors import safe_open  # optional: pip install safetensors

        self._safe_open = safe_open
        path = self.path
        if path.is_dir():
            path = path / SAFETENSORS_INDEX if (path / SAFETENSORS_INDEX).exists() else path / "model.safetensors"
        if path.name.endswith(".json"):
            weight_map = json.loads(path.read_text())["weight_map"]
            files = {name: path.parent / file for name, file in weight_map.items()}
        else:
            with safe_open(path, framework="pt") as f:
                files = {name: path for name in f.keys()}
        self._files = {f"{self.key}.{name}": (file, name) for name, file in files.items()}
        shapes = {}
        for file in sorted(set(files.values())):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    shapes[f"{self.key}.{name}"] = (sl.get_shape(), _safetensors_dtype(sl.get_dtype()))
        return shapes, {flat: (self.key, name) for flat, (_, name) in self._files.items()}

    def slice(self, name: str, offsets, lengths) -> torch.Tensor:
        file, inner = self._files[name]
        with self._safe_open(file, framework="pt") as f:
            sl = f.get_slice(inner)
            if not lengths:
                return f.get_tensor(inner)
            return sl[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def open_reader(path: str | os.PathLike, key: str | None = None,
                aliases: dict[str, str] | None = None) -> StorageReader:
    """The reader for ``path``: a checkpoint folder, a safetensors file/folder/index (entry ``key``,
    default ``"model"``), or a torch file (entry ``key``, or the whole nested state); ``aliases``:
    names a single file stores under another name (see the module docstring)."""
    path = Path(path)
    if not path.is_file() and not ((path / SAFETENSORS_INDEX).exists() or (path / "model.safetensors").exists()):
        for name, value in (("key", key), ("aliases", aliases)):
            if value:
                raise ValueError(f"{path} is a checkpoint folder: {name}= applies to single-file checkpoints only")
        return FolderReader(path)
    if path.is_dir() or path.suffix in (".safetensors", ".json"):
        return SafetensorsReader(path, key or "model", aliases)
    return TorchFileReader(path, key, aliases)
