"""DDP (and DDP x TP) training matches single-process training on the full batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ddp_cases import (
    MLP,
    TPBlock,
    batch,
    dp_tp_mesh,
    expected_flat,
    micro_batches,
    reference_mlp_run,
    reference_tp_run,
    rows,
    tp_batch,
    tp_loss,
)
from ndweave.ddp import DDP, DistributedDataParallel
from ndweave.mesh import DEVICE_MESH, init_device_mesh
from ndweave.mesh.collectives import all_gather_flat
from ndweave.mesh.testing import assert_close, run_distributed
from ndweave.mesh.torch_compat import local_tensor

NUM_STEPS = 20


def _dp_mesh_arg(kind: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("DP",))
    if kind == "submesh":
        return mesh["DP"]
    if kind == "parallel_mesh":
        return mesh
    if kind == "group":
        return mesh.get_group("DP")
    DEVICE_MESH.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("DP",))
    return None


def _train_mlp(*, overlap: bool, bucket_size, k: int, mode: str, mesh_kind: str):
    rank, size = dist.get_rank(), dist.get_world_size()
    expected, first_grads = reference_mlp_run(NUM_STEPS)
    ddp = DDP(MLP(), _dp_mesh_arg(mesh_kind), bucket_size=bucket_size, overlap_grad_reduce=overlap)
    if bucket_size is not None and bucket_size < 100:
        assert len(ddp.grad_buckets()) > 1
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(NUM_STEPS):
        x, y = batch(step)
        xs, ys = rows(x, rank, size), rows(y, rank, size)
        n = xs.shape[0] // k
        for i, ctx in micro_batches(ddp, k, mode):
            with ctx:
                (F.mse_loss(ddp(xs[i * n : (i + 1) * n]), ys[i * n : (i + 1) * n]) / k).backward()
        ddp.finish_grad_sync()
        if step == 0:
            for name, p in ddp.named_parameters():
                assert_close(p.grad, first_grads[name], name=f"{name}.grad")
                assert p.grad.data_ptr() == p.main_grad.data_ptr(), "fp32 .grad is a view of the buffer"
        opt.step()
        opt.zero_grad()
        for name, p in ddp.named_parameters():
            assert_close(p, expected[step][name], name=f"{name} after step {step}")


@pytest.mark.parity
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("bucket_size", [None, 40])
def test_dp_matches_single_device(world_size, overlap, bucket_size):
    run_distributed(_train_mlp, world_size, overlap=overlap, bucket_size=bucket_size, k=1, mode="no_sync",
                    mesh_kind="submesh")


@pytest.mark.parity
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", ["no_sync", "flag"])
@pytest.mark.parametrize("overlap", [True, False])
def test_dp_accumulation_matches_one_big_batch(world_size, mode, overlap):
    run_distributed(_train_mlp, world_size, overlap=overlap, bucket_size=40, k=3, mode=mode, mesh_kind="submesh")


@pytest.mark.parity
@pytest.mark.parametrize("mesh_kind", ["parallel_mesh", "group", "default"])
def test_dp_accepts_every_kind_of_mesh(mesh_kind):
    run_distributed(_train_mlp, 2, overlap=True, bucket_size=None, k=1, mode="no_sync", mesh_kind=mesh_kind)


# ---------------------------------------------------------------------- DP x TP
def _train_tp(*, tp_size: int, on_2d_mesh: bool, overlap: bool, bucket_size, k: int):
    mesh = dp_tp_mesh(tp_size)
    dp_rank, dp_size = mesh.get_data_parallel_rank(), mesh.get_strategy_size("DP")
    param_mesh = mesh.device_mesh if on_2d_mesh else mesh["TP"]
    expected, first_grads = reference_tp_run(NUM_STEPS)
    if tp_size > 1:  # the case under test: without DDP the norm weight's grad is Partial on TP
        probe = TPBlock(param_mesh)
        tp_loss(probe, *tp_batch(0), param_mesh, dp_rank, dp_size, slice(None)).backward()
        assert probe.norm.grad.placements[-1].is_partial(), probe.norm.grad.placements
    ddp = DDP(TPBlock(param_mesh), mesh["DP"], bucket_size=bucket_size, overlap_grad_reduce=overlap)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    local_rows = 24 // dp_size
    n = local_rows // k
    for step in range(NUM_STEPS):
        x, y = tp_batch(step)
        for i, ctx in micro_batches(ddp, k):
            with ctx:
                (tp_loss(ddp, x, y, param_mesh, dp_rank, dp_size, slice(i * n, (i + 1) * n)) / k).backward()
        ddp.finish_grad_sync()
        if step == 0:
            for name, p in ddp.named_parameters():
                assert tuple(p.grad.placements) == tuple(p.placements), name
                assert local_tensor(p.grad).data_ptr() == local_tensor(p.main_grad).data_ptr()
                assert_close(p.grad, first_grads[name], name=f"{name}.grad")
        opt.step()
        opt.zero_grad()
        for name, p in ddp.named_parameters():
            assert_close(p, expected[step][name], name=f"{name} after step {step}")


@pytest.mark.parity
@pytest.mark.parametrize(
    "world_size,tp_size", [(2, 2), (2, 1), (4, 2)], ids=["dp1xtp2", "dp2xtp1", "dp2xtp2"]
)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("on_2d_mesh", [False, True], ids=["tp_submesh", "dp_tp_mesh"])
def test_dp_tp_matches_single_device(world_size, tp_size, overlap, on_2d_mesh):
    run_distributed(_train_tp, world_size, tp_size=tp_size, on_2d_mesh=on_2d_mesh, overlap=overlap,
                    bucket_size=30, k=1)


@pytest.mark.parity
@pytest.mark.parametrize("on_2d_mesh", [False, True], ids=["tp_submesh", "dp_tp_mesh"])
def test_dp_tp_accumulation_matches_one_big_batch(on_2d_mesh):
    run_distributed(_train_tp, 4, tp_size=2, on_2d_mesh=on_2d_mesh, overlap=True, bucket_size=30, k=3)


# ---------------------------------------------------------------------- reduce-scatter contract
def _distributed_optimizer_contract(*, tp_size: int, bucket_size, zero_stage: int):
    """Rank r's shard of every bucket holds the single-device grads; stepping those shards and
    all-gathering ``param_data`` (what a sharded optimizer does) trains like one device. With
    ``zero_stage=2`` ``grad_data`` is that shard alone."""
    mesh = dp_tp_mesh(tp_size)
    dp_rank, dp_size = mesh.get_data_parallel_rank(), mesh.get_strategy_size("DP")
    group = mesh.get_group("DP")
    tp = tp_size > 1
    expected, first_grads = (reference_tp_run if tp else reference_mlp_run)(NUM_STEPS, lr=0.1, momentum=0.0)
    model = TPBlock(mesh["TP"]) if tp else MLP()
    ddp = DDP(model, mesh["DP"], bucket_size=bucket_size, zero_stage=zero_stage)
    for bucket in ddp.grad_buckets():
        assert bucket.numel % dp_size == 0
        assert bucket.param_data is not None and bucket.param_data.numel() == bucket.numel
        assert bucket.grad_data.numel() == bucket.numel // (dp_size if zero_stage == 2 else 1)
        for bp in bucket.params:  # params are views of param_data
            local = local_tensor(bp.param)
            assert local.data_ptr() == bucket.param_data[bp.offset :].data_ptr()
    for step in range(NUM_STEPS):
        if tp:
            x, y = tp_batch(step)
            tp_loss(ddp, x, y, mesh["TP"], dp_rank, dp_size, slice(None)).backward()
        else:
            x, y = batch(step)
            F.mse_loss(ddp(rows(x, dp_rank, dp_size)), rows(y, dp_rank, dp_size)).backward()
        ddp.finish_grad_sync()
        for bucket in ddp.grad_buckets():
            start, end = bucket.shard_range()
            assert (start, end) == bucket.shard_range(dp_rank)
            if step == 0:
                want = expected_flat(bucket, first_grads)
                assert_close(bucket.reduced_grad(), want[start:end], name=f"shard {start}:{end}")
            with torch.no_grad():  # plain SGD on the owned range, then gather the params
                bucket.param_data[start:end].add_(bucket.reduced_grad(), alpha=-0.1)
            all_gather_flat(bucket.param_data, bucket.param_data[start:end].clone(), group=group)
        ddp.zero_grad_buffer()
        for name, p in ddp.named_parameters():
            want = expected[step][name]
            assert_close(p, want, name=f"{name} after step {step}")


@pytest.mark.parity
@pytest.mark.parametrize("world_size,tp_size", [(2, 1), (4, 1), (4, 2)], ids=["dp2", "dp4", "dp2xtp2"])
@pytest.mark.parametrize("bucket_size", [None, 30])
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_distributed_optimizer_reduce_scatter_contract(world_size, tp_size, bucket_size, zero_stage):
    run_distributed(_distributed_optimizer_contract, world_size, tp_size=tp_size, bucket_size=bucket_size,
                    zero_stage=zero_stage)


def test_public_names():
    assert DDP is DistributedDataParallel


# ------------------------------------------------------------------ uneven TP shards and ZeRO
def _uneven_tp_layout_matches_across_tp():
    """With a sharded optimizer, Partial grads are TP-reduced over whole local tensors after the DP
    reduce-scatter, so TP peers must own the same elements: same bucket sizes, same offsets, even
    when a parameter ahead of them is sharded unevenly (vocab 9 over TP=2: 5 and 4 rows)."""
    mesh = dp_tp_mesh(2)
    tp_mesh = mesh["TP"]
    model = torch.nn.Module()
    model.register_parameter("norm", torch.nn.Parameter(distribute_tensor(torch.ones(8, dtype=torch.float64), tp_mesh, [Replicate()])))
    model.register_parameter("head", torch.nn.Parameter(distribute_tensor(torch.randn(9, 8, dtype=torch.float64), tp_mesh, [Shard(0)])))
    ddp = DDP(model, mesh["DP"], bucket_size=None, use_distributed_optimizer=True)
    layout = [(b.grad_data.numel(), [(bp.name, bp.offset) for bp in b.params]) for b in ddp.grad_buckets()]
    peers = [None, None]
    dist.all_gather_object(peers, layout, group=mesh.get_group("TP"))
    assert peers[0] == peers[1], f"TP peers lay their buckets out differently: {peers}"
    numels = {bp.name: bp.numel for b in ddp.grad_buckets() for bp in b.params}
    assert numels["head"] == (5 if mesh.get_tensor_parallel_rank() == 0 else 4) * 8


def test_uneven_tp_shards_keep_tp_peers_layouts_equal():
    run_distributed(_uneven_tp_layout_matches_across_tp, 4)
