"""``export``: a checkpoint written at any layout as one plain file (or HF-style safetensors).

Runs on one process (no collective): it reads whole tensors, so the entry exported must fit in that
process's memory (the safetensors export holds one shard at a time). Read it back into a sharded
model with :func:`~ndweave.checkpoint.load` (``key=`` the entry), each rank reading only its slices.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ndweave.checkpoint.loader import read_into, set_path
from ndweave.checkpoint.readers import SAFETENSORS_INDEX, open_reader

__all__ = ["export"]

#: Default largest safetensors shard (bytes), as HF writes them.
MAX_SHARD_BYTES = 5 * 2**30


def _read(reader: Any, path: str, names: list[str]) -> dict[str, Any]:
    md = reader.read_metadata().state_dict_metadata
    flat = {n: torch.empty(md[n].size, dtype=md[n].properties.dtype) if isinstance(md[n], TensorStorageMetadata)
            else None for n in names}
    read_into(flat, reader, path, collective=False)
    return flat


def export(path: str | os.PathLike, out: str | os.PathLike, *, format: Literal["torch", "safetensors"] = "torch",
           key: str | None = "model", max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write entry ``key`` of the checkpoint at ``path`` (e.g. the model's state dict, keyed by
    FQN, full tensors) to ``out``; returns ``out``.

    * ``format="torch"``: one ``torch.save`` file: ``model.load_state_dict(torch.load(out))``.
      ``key=None`` exports the whole nested state (optimizer state keyed by FQN, with master weights).
    * ``format="safetensors"``: the folder ``out`` with HF's layout, ``model.safetensors.index.json``
      and shards of at most ``max_shard_bytes`` (tensors only). Needs the ``safetensors`` package
      (``pip install ndweave-checkpoint[safetensors]``).
    """
    path, out = str(path), Path(out)
    reader = open_reader(path)
    metadata = reader.read_metadata()
    names = [n for n in metadata.state_dict_metadata if key is None or n == key or n.startswith(f"{key}.")]
    if not names:
        entries = sorted({n.split(".", 1)[0] for n in metadata.state_dict_metadata})
        raise KeyError(f"{path} has no entry {key!r}; its entries are {entries}")
    paths = metadata.planner_data or {}
    if format == "torch":
        nested: dict[str, Any] = {}
        for name, value in _read(reader, path, names).items():
            set_path(nested, paths.get(name) or tuple(name.split(".", 1)), value)
        torch.save(nested if key is None else nested[key], out)
        return out
    if format != "safetensors":
        raise ValueError(f"format must be 'torch' or 'safetensors', got {format!r}")
    if key is None:
        raise ValueError("a safetensors export holds one entry's tensors: pass key= (e.g. 'model')")
    from safetensors.torch import save_file  # optional: pip install safetensors

    md = metadata.state_dict_metadata
    tensors = [n for n in names if isinstance(md[n], TensorStorageMetadata)]
    shards: list[list[str]] = [[]]
    size = 0
    for name in tensors:
        nbytes = md[name].size.numel() * md[name].properties.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        values = {name[len(key) + 1 :]: t.contiguous() for name, t in _read(reader, path, shard).items()}
        save_file(values, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(values, file))
        total += sum(t.numel() * t.element_size() for t in values.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index_file, indent=2))
    return out
