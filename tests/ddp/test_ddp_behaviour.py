"""DDP's options, errors and the contracts it implements."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from ddp_cases import MLP, batch, reference_mlp_run, rows
from ndweave.ddp import DDP
from ndweave.mesh import init_device_mesh
from ndweave.mesh.contracts import DataParallelWrapper, GradSyncable, finish_grad_sync
from ndweave.mesh.testing import assert_close, distributed, measured_tolerance, run_distributed


def _dp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("DP",))["DP"]


def _local_step(ddp, step: int = 0, scale: float = 1.0):
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = batch(step)
    (F.mse_loss(ddp(rows(x, rank, size)), rows(y, rank, size)) * scale).backward()


@contextlib.contextmanager
def _forbid_collectives():
    names = ["all_reduce", "broadcast", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
             "all_gather", "barrier"]
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran")

    try:
        for n in saved:
            setattr(dist, n, forbidden)
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


# ---------------------------------------------------------------------- errors
@distributed(world_size=2)
def test_wrapping_twice_is_an_error():
    model = MLP()
    ddp = DDP(model, _dp_mesh())
    with pytest.raises(ValueError, match="already wrapped"):
        DDP(model, _dp_mesh())
    with pytest.raises(ValueError, match=r"DDP\(DDP\(model"):
        DDP(ddp, _dp_mesh())
    with pytest.raises(ValueError, match="already data-parallel"):
        DDP(torch.nn.Sequential(ddp), _dp_mesh())
    with pytest.raises(ValueError, match="already data-parallel"):
        DDP(torch.nn.Sequential(model), _dp_mesh())
    # a copy of the wrapped module (an EMA or evaluation copy) is a module of its own: it may be wrapped
    DDP(copy.deepcopy(model), _dp_mesh())


@distributed(world_size=2)
def test_mesh_without_a_dp_dim_is_an_error():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    for arg in (mesh, mesh["TP"]):
        with pytest.raises(ValueError, match="'DP'"):
            DDP(MLP(), arg)
    DDP(MLP(), mesh, dim="TP")  # naming the dim is the fix


@distributed(world_size=2)
def test_param_sharded_over_dp_is_an_error():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    model = torch.nn.Linear(4, 4, bias=False)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh["DP"], [Shard(0)]))
    with pytest.raises(ValueError, match="replicated over DP"):
        DDP(model, mesh["DP"])


@pytest.mark.parity
@distributed(world_size=2)
def test_dp_size_one_runs_no_collectives():
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("DP", "TP"))
    expected, _ = reference_mlp_run(3)
    with _forbid_collectives():
        ddp = DDP(MLP(), mesh["DP"], bucket_size=40)
        assert all(b.data_parallel_group is None and b.data_parallel_size == 1 for b in ddp.grad_buckets())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            x, y = batch(step)  # one DP rank: it sees the whole batch
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    for name, p in ddp.named_parameters():
        assert_close(p, expected[-1][name], name=name)


# ---------------------------------------------------------------------- options
@distributed(world_size=2)
def test_broadcast_from_dp_rank_zero_at_wrap_time():
    rank = dist.get_rank()
    model = torch.nn.BatchNorm1d(3)
    torch.nn.init.normal_(model.weight, generator=torch.Generator().manual_seed(rank))
    model.running_mean.fill_(rank)
    DDP(model, _dp_mesh())
    gathered = [torch.empty(3) for _ in range(2)]
    dist.all_gather(gathered, model.weight.detach().clone())
    assert torch.equal(gathered[0], gathered[1])
    assert torch.all(model.running_mean == 0)  # buffers come from rank 0 too

    other = MLP(seed=rank)
    DDP(other, _dp_mesh(), broadcast_params=False)
    gathered = [torch.empty(3, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(gathered, other.head.bias.detach().clone())
    assert not torch.equal(gathered[0], gathered[1])


@pytest.mark.parity
@pytest.mark.parametrize("world_size", [2, 4])
def test_summing_instead_of_averaging(world_size):
    run_distributed(_summing, world_size)


def _summing():
    _, first_grads = reference_mlp_run(1)
    ddp = DDP(MLP(), _dp_mesh(), average_grads=False)
    _local_step(ddp)
    for name, p in ddp.named_parameters():
        assert_close(p.grad, first_grads[name] * dist.get_world_size(), name=name)


@pytest.mark.parity
@distributed(world_size=2)
def test_ignored_params_keep_their_local_grads():
    plain = MLP()
    _local_step(plain)
    ddp = DDP(MLP(), _dp_mesh(), params_to_ignore=["head.bias"], bucket_size=40)
    assert "head.bias" not in {bp.name for b in ddp.grad_buckets() for bp in b.params}
    _local_step(ddp)
    assert_close(ddp.module.head.bias.grad, plain.head.bias.grad, name="ignored head.bias.grad")
    gathered = [torch.empty(3, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(gathered, ddp.module.head.bias.grad.clone())
    assert not torch.equal(gathered[0], gathered[1]), "an ignored grad was synced"
    _, first_grads = reference_mlp_run(1)
    assert_close(ddp.module.head.weight.grad, first_grads["head.weight"], name="synced head.weight.grad")
    with pytest.raises(ValueError, match="does not have"):
        DDP(MLP(), _dp_mesh(), params_to_ignore=["nope.weight"])


@pytest.mark.kernels
@pytest.mark.parity
@distributed(world_size=2)
def test_bf16_params_reduce_grads_in_fp32():
    ddp = DDP(MLP(dtype=torch.bfloat16), _dp_mesh(), bucket_size=40)
    assert all(b.grad_data.dtype == torch.float32 for b in ddp.grad_buckets())
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = batch(0, dtype=torch.bfloat16)
    F.mse_loss(ddp(rows(x, rank, size)), rows(y, rank, size)).backward()
    # reference: the same bf16 model run on each rank's rows, grads upcast and averaged in fp32,
    # once in each order: their spread bounds ours
    expected, reordered = (_bf16_mean_grads(x, y, size, order) for order in (1, -1))
    tol = measured_tolerance(expected, reordered)
    for name, p in ddp.named_parameters():
        assert p.grad.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32
        assert torch.equal(p.grad, p.main_grad.to(torch.bfloat16))
        assert_close(p.main_grad, expected[name], name=name, tol=tol)

    ddp16 = DDP(MLP(dtype=torch.bfloat16), _dp_mesh(), accumulate_allreduce_grads_in_fp32=False)
    assert all(b.grad_data.dtype == torch.bfloat16 for b in ddp16.grad_buckets())
    F.mse_loss(ddp16(rows(x, rank, size)), rows(y, rank, size)).backward()
    for p in ddp16.parameters():
        assert p.grad.data_ptr() == p.main_grad.data_ptr()


def _bf16_mean_grads(x, y, size: int, order: int) -> dict[str, torch.Tensor]:
    ref = MLP(dtype=torch.bfloat16)
    total = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
    for r in list(range(size))[::order]:
        ref.zero_grad()
        F.mse_loss(ref(rows(x, r, size)), rows(y, r, size)).backward()
        for n, p in ref.named_parameters():
            total[n] += p.grad.float() / size
    return total


# ---------------------------------------------------------------------- grad semantics
@pytest.mark.parity
@distributed(world_size=2)
def test_grads_add_up_until_zeroed_like_torch():
    """Two synced backward passes without zero_grad: grads are the sum of both reduced grads."""
    _, g0 = reference_mlp_run(1)
    ddp = DDP(MLP(), _dp_mesh(), bucket_size=40)
    _local_step(ddp, 0)
    _local_step(ddp, 0)  # no no_sync, no zero_grad: torch's DDP gives the sum, so do we
    for name, p in ddp.named_parameters():
        assert_close(p.grad, 2 * g0[name], name=name)
    ddp.zero_grad_buffer()
    assert all(p.grad is None for p in ddp.parameters())
    assert all(torch.all(b.grad_data == 0) for b in ddp.grad_buckets())
    _local_step(ddp, 0)
    for name, p in ddp.named_parameters():
        assert_close(p.grad, g0[name], name=name)


@distributed(world_size=2)
def test_collectives_overlap_backward():
    calls = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append(("all_reduce", kwargs.get("async_op")))
        return original(tensor, *args, **kwargs)

    ddp = DDP(MLP(), _dp_mesh(), bucket_size=40)
    assert len(ddp.grad_buckets()) == 3
    # fc1 is first in the model, so its grads are the last backward produces
    ddp.module.fc1.weight.register_hook(lambda g: calls.append(("fc1 grad", None)))
    dist.all_reduce = spy
    try:
        _local_step(ddp)
    finally:
        dist.all_reduce = original
    first_fc1 = calls.index(("fc1 grad", None))
    assert calls[:first_fc1] == [("all_reduce", True)] * 2, calls  # buckets of head and fc2, async
    assert calls.count(("all_reduce", True)) == 3


@pytest.mark.parity
@distributed(world_size=2)
def test_grads_ready_only_after_finish_when_asked():
    ddp = DDP(MLP(), _dp_mesh(), finish_grad_sync_in_backward=False)
    _local_step(ddp)
    assert all(p.grad is None for p in ddp.parameters())
    assert isinstance(ddp, GradSyncable) and isinstance(ddp, DataParallelWrapper)
    finish_grad_sync([ddp])  # what an optimizer calls
    _, g0 = reference_mlp_run(1)
    for name, p in ddp.named_parameters():
        assert_close(p.grad, g0[name], name=name)
    ddp.finish_grad_sync()  # twice is harmless
    for name, p in ddp.named_parameters():
        assert_close(p.grad, g0[name], name=name)


class _WithUnused(MLP):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(3, 3)


@distributed(world_size=2)
def test_unused_params_get_zero_grads():
    ddp = DDP(_WithUnused(), _dp_mesh(), bucket_size=40)
    for _ in range(2):
        _local_step(ddp)
        assert torch.all(ddp.module.unused.weight.grad == 0)
        ddp.module.zero_grad()


# ---------------------------------------------------------------------- looks like the module
@distributed(world_size=2)
def test_state_dict_and_names_look_like_the_module():
    model = MLP()
    ddp = DDP(model, _dp_mesh(), use_distributed_optimizer=True)
    assert list(ddp.state_dict()) == list(model.state_dict())
    assert [n for n, _ in ddp.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert ddp.module is model
    ptrs = [p.data_ptr() for p in ddp.parameters()]
    new = {k: torch.full_like(v, 0.5) for k, v in ddp.state_dict().items()}
    ddp.load_state_dict(new)
    assert [p.data_ptr() for p in ddp.parameters()] == ptrs, "params stay views of the buffers"
    assert all(torch.all(b.param_data[: sum(bp.numel for bp in b.params)] == 0.5) for b in ddp.grad_buckets())
    with pytest.raises(ValueError, match="assign=True"):
        ddp.load_state_dict(new, assign=True)

    parent = torch.nn.ModuleDict({"body": ddp})
    keys = list(parent.state_dict())
    assert keys == ["body." + k for k in model.state_dict()]
    parent.load_state_dict({k: torch.zeros_like(v) for k, v in parent.state_dict().items()})
    assert all(torch.all(p == 0) for p in model.parameters())


@pytest.mark.parametrize("world_size", [2, 4])
def test_bucket_layout(world_size):
    run_distributed(_bucket_layout, world_size)


def _bucket_layout():
    model = MLP()
    ddp = DDP(model, _dp_mesh(), bucket_size=40)
    names = [bp.name for b in ddp.grad_buckets() for bp in b.params]
    assert names == [n for n, _ in model.named_parameters()][::-1], "reverse registration order"
    for b in ddp.grad_buckets():
        assert b.grad_data.numel() % dist.get_world_size() == 0
        offset = 0
        for bp in b.params:
            assert bp.offset == offset and bp.numel == bp.param.numel()
            offset += bp.numel
        assert b.param_data is None


class _Checkpointed(MLP):
    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.tanh(self.fc2(torch.tanh(self.fc1(t)))), x, use_reentrant=True)
        return self.head(h)


@pytest.mark.parity
@distributed(world_size=2)
def test_reentrant_checkpointing_still_gives_the_right_grads():
    _, g0 = reference_mlp_run(1)
    ddp = DDP(_Checkpointed(), _dp_mesh(), bucket_size=40)
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = batch(0)
    F.mse_loss(ddp(rows(x, rank, size).requires_grad_()), rows(y, rank, size)).backward()
    for name, p in ddp.named_parameters():
        assert_close(p.grad, g0[name], name=name)
