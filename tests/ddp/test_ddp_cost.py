"""The bucket layout is computed before anything is allocated (``plan_buckets``), and DDP allocates
exactly that: a memory estimate calling the same function cannot drift from what is built."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.ddp.buffer import plan_buckets, plan_buffers
from ndweave.mesh import init_device_mesh
from ndweave.mesh.contracts import padded_bucket_numel
from ndweave.mesh.testing import distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(37, 12), nn.Linear(12, 30), nn.GELU(), nn.Linear(30, 7, bias=False))


def test_plan_packs_and_pads_each_bucket():
    sizes = [("c", 10, 10), ("b", 20, 20), ("a", 5, 5)]
    plan = plan_buckets(sizes, data_parallel_size=4, bucket_size=25)
    assert [[name for name, _, _ in b.entries] for b in plan] == [["c", "b"], ["a"]]
    assert plan[0].entries == (("c", 0, 10), ("b", 10, 20))
    assert (plan[0].start, plan[0].end) == (0, padded_bucket_numel(30, 4))
    assert (plan[1].start, plan[1].end) == (plan[0].end, plan[0].end + padded_bucket_numel(5, 4))
    assert len(plan_buckets(sizes, data_parallel_size=4, bucket_size=None)) == 1
    assert plan_buckets([], data_parallel_size=4, bucket_size=None) == []


@distributed(world_size=2, timeout=60)
def test_ddp_allocates_exactly_the_planned_layout():
    for bucket_size, zero in ((None, False), (100, True), (1, False)):
        model = _model()
        named = list(reversed(list(model.named_parameters())))
        plan = plan_buckets([(n, p.numel(), p.numel()) for n, p in named], data_parallel_size=dist.get_world_size(),
                            bucket_size=bucket_size)
        ddp = DDP(model, init_device_mesh("cpu", (2,), mesh_dim_names=("DP",)), bucket_size=bucket_size,
                  use_distributed_optimizer=zero)
        buckets = ddp.grad_buckets()
        assert [b.grad_data.numel() for b in buckets] == [b.end - b.start for b in plan]
        assert [[(q.name, q.offset, q.numel) for q in b.params] for b in buckets] == [list(b.entries) for b in plan]
        assert all((b.param_data is not None) == zero for b in buckets)


@distributed(world_size=2, timeout=60)
def test_ddp_allocates_exactly_the_planned_buffers_per_dtype():
    model = _model()
    model[1].to(torch.bfloat16)  # two buffers: bf16 params (fp32 grads) apart from fp32 ones
    fp32 = lambda dt: torch.promote_types(dt, torch.float32)  # noqa: E731
    plans = plan_buffers([(n, p.dtype, p.numel(), p.numel(), "DP", 2) for n, p in model.named_parameters()],
                         bucket_size=100, grad_dtype_of=fp32)
    ddp = DDP(model, init_device_mesh("cpu", (2,), mesh_dim_names=("DP",)), bucket_size=100,
              use_distributed_optimizer=True)
    buckets = ddp.grad_buckets()
    assert [p.param_dtype for p in plans] == [torch.float32, torch.bfloat16]
    assert [[(q.name, q.offset, q.numel) for q in b.params] for b in buckets] == \
        [list(b.entries) for p in plans for b in p.buckets]
    assert sum(b.grad_data.numel() * b.grad_data.element_size() for b in buckets) == sum(p.grad_bytes() for p in plans)
    assert sum(b.param_data.numel() * b.param_data.element_size() for b in buckets) == sum(p.param_bytes() for p in plans)


@distributed(world_size=2, timeout=60)
def test_zero2_keeps_the_planned_grad_shards_and_frees_full_buckets_after_backward():
    model = _model()
    fp32 = lambda dt: torch.promote_types(dt, torch.float32)  # noqa: E731
    plans = plan_buffers([(n, p.dtype, p.numel(), p.numel(), "DP", 2) for n, p in model.named_parameters()],
                         bucket_size=100, grad_dtype_of=fp32)
    ddp = DDP(model, init_device_mesh("cpu", (2,), mesh_dim_names=("DP",)), bucket_size=100, zero_stage=2)
    kept = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.grad_buckets())
    assert kept == sum(p.grad_bytes(zero_stage=2) for p in plans) == sum(p.grad_bytes() for p in plans) // 2
    assert max(p.bucket_grad_bytes() for p in plans) == max(b.numel for b in ddp.grad_buckets()) * 4
    ddp(torch.arange(6).reshape(2, 3)).sum().backward()
    # after backward only the shards hold grads: no full-size bucket, no view of one, no .grad
    assert all(slot.main_grad is None for slot in ddp._slots)
    assert all(p.grad is None for p in ddp.parameters())


@distributed(world_size=2, timeout=60)
def test_zero2_holds_exactly_the_full_size_buckets_grad_sync_counts():
    """``grad_sync(..., zero_stage=2)``: during a backward, the full-size buckets alive at once (those
    reducing and the one filling) are ``in_flight`` bytes at most, and reached; as its last bucket is
    launched, those still reducing are ``reduce_copy`` bytes. ZeRO-1 holds neither, only its
    ``.grad`` copies where the grad buffer is wider than the parameter."""
    from ndweave.ddp.cost import grad_dtype, grad_sync, published_grad_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(6)])  # six equal buckets of 64
    plans = plan_buffers([(n, p.dtype, p.numel(), p.numel(), "DP", 2) for n, p in model.named_parameters()],
                         bucket_size=64, grad_dtype_of=grad_dtype)
    ddp = DDP(model, init_device_mesh("cpu", (2,), mesh_dim_names=("DP",)), bucket_size=64, zero_stage=2)
    shards, alive, launched = ddp._grad_shards, [], []
    opened, launch = shards.open, shards.launch

    def full_bytes() -> int:
        return sum(f.numel() * f.element_size() for f in shards.full if f is not None)

    def counting_open(index: int) -> None:
        opened(index)
        alive.append(full_bytes())

    def counting_launch(index, op) -> None:
        launch(index, op)
        launched.append(full_bytes())

    shards.open, shards.launch = counting_open, counting_launch
    ddp(torch.randn(2, 8)).sum().backward()
    sync = grad_sync(plans, zero_stage=2)
    assert len(plans[0].buckets) == 6 and max(alive) == sync.in_flight == 3 * plans[0].bucket_grad_bytes()
    assert launched[-1] == sync.reduce_copy == 2 * plans[0].bucket_grad_bytes()
    assert grad_sync(plans, zero_stage=1, published=7) == type(sync)(published=7, reduce_copy=0)
    assert published_grad_bytes([(torch.bfloat16, 10), (torch.float32, 10)]) == 20
