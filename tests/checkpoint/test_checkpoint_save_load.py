"""``save`` / ``load`` round trips: every kind of entry on one process; a fused ``StridedShard`` weight
(which DCP alone refuses) across world sizes and into plain ``dcp.load``; sharded ``StatePiece`` state
(flat ranges cutting rows, TP replicas) resharded to another grid and to one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh

from checkpoint_cases import Fused, ShardedState, assert_same, full_weights, mlp, step
from ndweave.checkpoint import DataPosition, load, save
from ndweave.mesh.contracts import ShardLayout, StatePiece
from ndweave.mesh.testing import run_distributed


def test_every_kind_of_entry_round_trips_on_one_process(tmp_path):
    model = mlp(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for i in range(2):
        step(model, optimizer, seed=i)
        scheduler.step()
    position = DataPosition(samples_seen=96)
    rng = torch.get_rng_state()
    save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": position,
                              "step": 2, "rng": rng, "extra": {"tokens": 123, "ids": torch.arange(3)}})

    other = mlp(seed=1)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.7)  # never stepped: no state yet
    other_scheduler = torch.optim.lr_scheduler.StepLR(other_optimizer, step_size=5)
    state = {"model": other, "optimizer": other_optimizer, "scheduler": other_scheduler, "data": DataPosition(),
             "step": 0, "rng": torch.zeros_like(rng), "extra": {"tokens": 0, "ids": torch.zeros(3, dtype=torch.long)}}
    result = load(tmp_path / "ckpt", state)

    assert not (result.missing or result.unexpected or result.mismatched)
    assert_same(dict(other.named_parameters()), dict(model.named_parameters()))
    for p, q in zip(model.parameters(), other.parameters()):
        assert set(other_optimizer.state[q]) == set(optimizer.state[p])
        for key, value in optimizer.state[p].items():
            assert torch.equal(other_optimizer.state[q][key], value), key
    assert other_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.025
    assert other_scheduler.state_dict() == scheduler.state_dict()
    assert state["data"].samples_seen == 96 and state["step"] == 2 and state["extra"]["tokens"] == 123
    assert torch.equal(state["rng"], rng) and torch.equal(state["extra"]["ids"], torch.arange(3))
    # and the optimizer goes on exactly as the original
    step(model, optimizer, seed=7)
    step(other, other_optimizer, seed=7)
    assert_same(dict(other.named_parameters()), dict(model.named_parameters()))


def _save_fused(folder: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    save(f"{folder}/fused", {"model": Fused(mesh)})


def _load_fused(folder: str, strided: bool) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Fused(mesh, strided=strided, seed=1)
    load(f"{folder}/fused", {"model": model})
    assert_same(dict(model.named_parameters()), full_weights())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # plain dcp.load on one process says so
def test_strided_shard_weights_reshard_across_world_sizes_and_read_with_plain_dcp(tmp_path):
    folder = str(tmp_path)
    run_distributed(_save_fused, 4, folder)
    run_distributed(_load_fused, 2, folder, True)   # StridedShard at another world size
    run_distributed(_load_fused, 4, folder, False)  # Shard(1): another layout altogether

    model = Fused(seed=1)  # one process, no process group
    load(tmp_path / "fused", {"model": model})
    assert_same(dict(model.named_parameters()), full_weights())
    plain = {"model": {name: torch.zeros_like(v) for name, v in full_weights().items()}}
    dcp.load(plain, checkpoint_id=tmp_path / "fused", no_dist=True)  # torch's own reader, its own planner
    assert_same(plain["model"], full_weights())
    dcp_to_torch_save(tmp_path / "fused", tmp_path / "fused.pt")
    assert_same(torch.load(tmp_path / "fused.pt")["model"], full_weights())


def _full(shape=(6, 5)) -> torch.Tensor:
    return torch.arange(30, dtype=torch.float64).reshape(shape) * 1.5


def _save_pieces(folder: str) -> None:
    rank = dist.get_rank()  # DP=2 x TP=2: each rank a flat range of its TP shard; a TP-replicated tensor too
    save(f"{folder}/pieces", {"opt": ShardedState(_full(), 2, 2, rank),
                              "replicated": ShardedState(_full() + 1, 2, 2, rank, replicated=True)})


def _load_pieces(folder: str) -> None:
    rank = dist.get_rank()  # DP=1 x TP=2 sharded on the other tensor dim; replicas load too
    opt, rep = ShardedState(_full() * 0, 1, 2, rank, tp_dim=1), ShardedState(_full() * 0, 2, 1, rank, replicated=True)
    load(f"{folder}/pieces", {"opt": opt, "replicated": rep})
    for got, full in ((opt, _full()), (rep, _full() + 1)):
        expected = ShardedState(full, *((1, 2) if got is opt else (2, 1)), rank, tp_dim=1 if got is opt else 0,
                                replicated=got is rep)
        assert torch.equal(got.piece.data, expected.piece.data)


def test_sharded_state_pieces_reshard_to_another_grid_and_to_one_process(tmp_path):
    folder = str(tmp_path)
    run_distributed(_save_pieces, 4, folder)
    metadata = dcp.FileSystemReader(tmp_path / "pieces").read_metadata()
    assert metadata.state_dict_metadata["opt.w"].size == (6, 5)  # one global tensor per key
    run_distributed(_load_pieces, 2, folder)

    whole = StatePiece("w", torch.zeros(30, dtype=torch.float64), ShardLayout.whole((6, 5)))
    holder = ShardedState(_full(), 1, 1, 0)
    holder.piece = whole
    load(tmp_path / "pieces", {"opt": holder}, strict=False)
    assert torch.equal(holder.piece.data.view(6, 5), _full())


def test_a_model_given_as_chunks_saves_and_loads_as_the_whole(tmp_path):
    whole = mlp(seed=0)
    chunks = [whole[:2], whole[2:]]  # e.g. two pipeline stages on one rank: the original FQNs, disjoint
    optimizers = [torch.optim.Adam(c.parameters(), lr=0.1) for c in chunks]
    x = torch.randn(5, 4)
    whole(x).square().mean().backward()
    for optimizer in optimizers:
        optimizer.step()
    save(tmp_path / "chunks", {"model": chunks, "optimizer": optimizers})

    other = mlp(seed=1)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.5)
    load(tmp_path / "chunks", {"model": other, "optimizer": other_optimizer})  # the whole model
    assert_same(dict(other.named_parameters()), dict(whole.named_parameters()))
    assert other_optimizer.param_groups[0]["lr"] == 0.1
    for p, q in zip(whole.parameters(), other.parameters()):
        owner = next(o for o in optimizers if p in o.state)
        assert torch.equal(other_optimizer.state[q]["exp_avg"], owner.state[p]["exp_avg"])

    save(tmp_path / "whole", {"model": other, "optimizer": other_optimizer})
    again = mlp(seed=2)
    again_chunks = [again[:2], again[2:]]
    again_optimizers = [torch.optim.Adam(c.parameters(), lr=0.5) for c in again_chunks]
    load(tmp_path / "whole", {"model": again_chunks, "optimizer": again_optimizers})  # and back into chunks
    assert_same(dict(again.named_parameters()), dict(whole.named_parameters()))
    assert torch.equal(again_optimizers[1].state[again[2].weight]["exp_avg_sq"],
                       optimizers[1].state[whole[2].weight]["exp_avg_sq"])
