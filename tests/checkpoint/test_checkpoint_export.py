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


def _hf_tied_folder(folder) -> dict[str, torch.Tensor]:
    """An HF-style folder as transformers writes a tied model: the LM head stored only as the
    embedding it shares (float32), with one other weight; returns the values."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    values = {"embed.weight": torch.randn(8, 4, generator=g), "norm.weight": torch.randn(4, generator=g)}
    save_file(values, folder / "model.safetensors", metadata={"format": "pt"})
    return values


def _tied_model(mesh=None) -> torch.nn.Module:
    """The tied pair as two tensors (the embedding and the LM head on different pipeline stages),
    each ``Shard(0)`` over the ranks, and a norm weight; zeros in float64."""
    root = torch.nn.Module()
    for name, shape in (("embed", (8, 4)), ("head", (8, 4))):
        value = torch.zeros(shape, dtype=torch.float64)
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            value = distribute_tensor(value, mesh, [Shard(0)])
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(value)
        root.add_module(name, layer)
    root.norm = torch.nn.Module()
    root.norm.weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    return root


def _load_aliased(folder: str) -> list[tuple]:
    from ndweave.checkpoint.readers import SafetensorsReader

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, reads, slice_of = _tied_model(mesh), [], SafetensorsReader.slice

    def spy(self, name, offsets, lengths):
        reads.append((name, tuple(offsets), tuple(lengths)))
        return slice_of(self, name, offsets, lengths)

    SafetensorsReader.slice = spy
    try:
        load(folder, {"model": model}, aliases={"head.weight": "embed.weight"})
    finally:
        SafetensorsReader.slice = slice_of
    values = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    return [values, sorted(reads)]


def test_a_tied_weight_stored_once_loads_under_both_names_each_rank_reading_its_rows(tmp_path):
    pytest.importorskip("safetensors")
    from ndweave.checkpoint import CheckpointError, CheckpointMismatchError

    stored = _hf_tied_folder(tmp_path)
    results = run_distributed(_load_aliased, 2, str(tmp_path))
    for rank, (values, reads) in enumerate(results):
        expected = {"embed.weight": stored["embed.weight"], "head.weight": stored["embed.weight"],
                    "norm.weight": stored["norm.weight"]}
        assert_same(values, expected)
        # rows 4r..4r+3 of the one stored tensor, once for each name
        rows = [("model.embed.weight", (4 * rank, 0), (4, 4))] * 2
        assert [r for r in reads if r[0] != "model.norm.weight"] == rows, (rank, reads)

    model = _tied_model()  # one process, a torch state dict holding the embedding only
    torch.save({"embed.weight": stored["embed.weight"], "norm.weight": stored["norm.weight"]}, tmp_path / "sd.pt")
    load(tmp_path / "sd.pt", {"model": model}, key="model", aliases={"head.weight": "embed.weight"})
    assert torch.equal(model.head.weight, stored["embed.weight"].double())
    with pytest.raises(CheckpointMismatchError, match="model.head.weight"):
        load(tmp_path, {"model": _tied_model()})  # without aliases: missing, named
    with pytest.raises(CheckpointError, match="wte.weight"):
        load(tmp_path, {"model": _tied_model()}, aliases={"head.weight": "wte.weight"})
    with pytest.raises(ValueError, match="aliases= applies to single-file"):
        load(tmp_path / "nothing", {"model": _tied_model()}, aliases={"head.weight": "embed.weight"})
