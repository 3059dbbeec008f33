"""DistributedOptimizer state: StatePiece state dicts that reshard across DP sizes and load into a
single-device torch optimizer; optimizer-state memory per rank."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from ndweave.mesh.contracts import StatePiece
from ndweave.mesh.testing import ReferenceDataParallel, assert_close, distributed, run_distributed
from ndweave.optim import DistributedOptimizer, merge_state_dicts, to_torch_state_dict

from optim_common import assert_params_match, dp_setup, make_model, tp_setup, train, train_reference

LR = {"lr": 1e-2}


def _save_at_dp4(folder: str) -> None:
    rank = dist.get_rank()
    reference, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs=LR, clip_grad=0.1)
    train(ddp, opt, 10, rank, 4)
    torch.save(opt.state_dict(), os.path.join(folder, f"optim_rank{rank}.pt"))
    train(ddp, opt, 10, rank, 4, first_step=10)  # the uninterrupted run
    # the baseline the resumed runs are held to is itself single-process training
    train_reference(reference, torch.optim.Adam(reference.parameters(), **LR), 20, clip=0.1)
    assert_params_match(ddp.module, reference)
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in ddp.module.named_parameters()}, os.path.join(folder, "final.pt"))


def _load_at_dp2(folder: str) -> None:
    rank = dist.get_rank()
    _, ddp = dp_setup(seed=123)  # other initial weights: the checkpoint's masters must replace them
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 0.5}, clip_grad=0.1)
    opt.load_state_dict([torch.load(os.path.join(folder, f"optim_rank{r}.pt"), weights_only=False) for r in range(4)])
    assert opt.param_groups[0]["lr"] == LR["lr"]
    train(ddp, opt, 10, rank, 2, first_step=10)
    final = torch.load(os.path.join(folder, "final.pt"))
    for n, p in ddp.module.named_parameters():
        assert_close(p, final[n], name=n)


def test_checkpoint_at_dp4_resumes_at_dp2_and_on_one_device(tmp_path):
    folder = str(tmp_path)
    run_distributed(_save_at_dp4, 4, folder)
    run_distributed(_load_at_dp2, 2, folder)

    # one device, plain torch.optim.Adam: masters into the model, the rest into the optimizer
    full = merge_state_dicts([torch.load(tmp_path / f"optim_rank{r}.pt", weights_only=False) for r in range(4)])
    model = make_model(seed=123)
    model.load_state_dict({n: e["master_param"] for n, e in full["state"].items()})
    adam = torch.optim.Adam(model.parameters(), lr=0.5)
    adam.load_state_dict(to_torch_state_dict(full, [[n for n, _ in model.named_parameters()]]))
    assert adam.param_groups[0]["lr"] == LR["lr"]
    train_reference(model, adam, 10, clip=0.1, first_step=10)
    final = torch.load(tmp_path / "final.pt")
    for n, p in model.named_parameters():
        assert_close(p, final[n], name=n)


@distributed(world_size=4)
def test_state_dict_holds_every_state_tensor_with_global_placement():
    reference, ddp, dp_rank, dp_size = tp_setup()
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs=LR)
    train(ddp, opt, 3, dp_rank, dp_size)
    sd = opt.state_dict()
    for fqn, entry in sd["state"].items():
        assert {"master_param", "exp_avg", "exp_avg_sq", "step"} <= set(entry)
        shard = entry["exp_avg"]
        assert isinstance(shard, StatePiece) and shard.fqn == fqn and shard.data.numel() == shard.end - shard.start
        assert shard.layout.global_shape == tuple(dict(reference.named_parameters())[fqn].shape)
    # the full state equals a single-device Adam's after the same steps
    full = opt.gather_full_state_dict()
    ref_opt = torch.optim.Adam(reference.parameters(), **LR)
    train_reference(reference, ref_opt, 3)
    for (n, p) in reference.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(full["state"][n][key], ref_opt.state[p][key], name=f"{n} {key}")
        assert_close(full["state"][n]["master_param"], p, name=f"{n} master")
        assert float(full["state"][n]["step"]) == 3
    # and loads back (full form) into a fresh DP x TP optimizer
    _, ddp2, _, _ = tp_setup(seed=7)
    opt2 = DistributedOptimizer(torch.optim.Adam, [ddp2], optimizer_kwargs=LR)
    opt2.load_state_dict(full)
    assert_params_match(ddp2.module, reference)


def _measure_state_bytes() -> tuple[int, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    reference = copy.deepcopy(model)
    ddp = ReferenceDataParallel(model, dist.group.WORLD, bucket_size=5000, alignment=1, use_distributed_optimizer=True)
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs=LR)
    ddp(torch.randn(4, 64)).sum().backward()
    opt.step()
    ref_opt = torch.optim.Adam(reference.parameters(), **LR)
    reference(torch.randn(4, 64)).sum().backward()
    ref_opt.step()
    unsharded = sum(v.numel() * v.element_size() for s in ref_opt.state.values() for v in s.values())
    return opt.optimizer_state_bytes(), unsharded


@distributed(world_size=2)
def test_optimizer_state_bytes_per_rank_is_unsharded_over_dp2():
    ours, unsharded = _measure_state_bytes()
    print(f"rank {dist.get_rank()}: {ours} state bytes, unsharded {unsharded} / 2 = {unsharded / 2}")
    assert abs(ours * 2 / unsharded - 1) < 0.02


@distributed(world_size=4)
def test_optimizer_state_bytes_per_rank_is_unsharded_over_dp4():
    ours, unsharded = _measure_state_bytes()
    print(f"rank {dist.get_rank()}: {ours} state bytes, unsharded {unsharded} / 4 = {unsharded / 4}")
    assert abs(ours * 4 / unsharded - 1) < 0.02
