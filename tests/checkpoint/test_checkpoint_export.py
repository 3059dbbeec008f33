"""``export``: a checkpoint written on 2 ranks (a ``StridedShard`` fused weight) as one torch file and
as HF-style safetensors, each read back by plain torch / into a sharded model (every rank reading
only its slices of the file)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from checkpoint_cases import Fused, assert_same, full_weights
from ndweave.checkpoint import export, load, save
from ndweave.mesh.testing import run_distributed


def _save(folder: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    save(f"{folder}/ckpt", {"model": Fused(mesh), "step": 9})


def _load_file(source: str, key: str | None, strided: bool) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Fused(mesh, strided=strided, seed=1)
    load(source, {"model": model}, key=key)
    assert_same(dict(model.named_parameters()), full_weights())


def test_torch_file_export_round_trips_into_plain_and_sharded_models(tmp_path):
    run_distributed(_save, 2, str(tmp_path))
    out = export(tmp_path / "ckpt", tmp_path / "model.pt")
    assert_same(torch.load(out, weights_only=True), full_weights())  # a plain state dict, full tensors
    everything = torch.load(export(tmp_path / "ckpt", tmp_path / "all.pt", key=None), weights_only=True)
    assert everything["step"] == 9 and set(everything["model"]) == {"qkv", "bias"}

    run_distributed(_load_file, 2, str(out), "model", True)
    model = Fused(seed=1)  # the whole state file, on one process
    load(tmp_path / "all.pt", {"model": model, "step": 0})
    assert_same(dict(model.named_parameters()), full_weights())
    with pytest.raises(KeyError, match="'optimizer'"):
        export(tmp_path / "ckpt", tmp_path / "x.pt", key="optimizer")


def test_safetensors_export_is_hf_shaped_and_loads_back(tmp_path):
    pytest.importorskip("safetensors")
    run_distributed(_save, 2, str(tmp_path))
    out = export(tmp_path / "ckpt", tmp_path / "hf", format="safetensors", max_shard_bytes=100)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["bias", "qkv"] and len(set(index["weight_map"].values())) == 2
    assert index["metadata"]["total_size"] == sum(v.numel() * 8 for v in full_weights().values())
    run_distributed(_load_file, 2, str(out), None, False)  # HF folders hold the "model" entry
