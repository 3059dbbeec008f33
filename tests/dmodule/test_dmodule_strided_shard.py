"""``_StridedShard`` in parameter plans: checked like ``Shard``; eager, pre-sharded and deferred-init
distribution all give exactly ``distribute_tensor``'s local shards; deferred init keeps only them."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from ndweave.mesh.torch_compat import StridedShard as _StridedShard

from ndweave.dmodule import PlacementSpec, deferred_init, parallelize_module
from ndweave.dmodule.api import local_shard
from ndweave.dmodule.plan import check_placements
from ndweave.mesh.testing import run_distributed
from ndweave.mesh import fake_world
from ndweave.mesh.testing.memory import TensorMemory


def _s(dim: int, factor: int = 3) -> _StridedShard:
    return _StridedShard(dim, split_factor=factor)


def test_check_placements_takes_strided_shards():
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
        w = torch.empty(4, 12)
        out = check_placements(PlacementSpec([_s(-1)]), w, mesh, "parameter 'qkv.weight'")
        assert out == (_s(1),) and isinstance(out[0], _StridedShard) and out[0].split_factor == 3
        for bad in (2, -3):
            with pytest.raises(ValueError, match=rf"'qkv.weight': _StridedShard\(dim={bad}, sf=3\) is out of "
                                                 r"range for a 2-D tensor of shape \(4, 12\).*DeviceMesh\(cpu"):
                check_placements(PlacementSpec([_s(bad)]), w, mesh, "parameter 'qkv.weight'")
        with pytest.raises(ValueError, match=r"2 placements.*1-D mesh.*one placement per mesh dim"):
            check_placements(PlacementSpec([_s(1), Replicate()]), w, mesh, "parameter 'qkv.weight'")
        with pytest.raises(ValueError, match="split_factor >= 1"):
            check_placements(PlacementSpec([_s(1, 0)]), w, mesh, "parameter 'qkv.weight'")
        # torch's distribute_tensor needs equal strided pieces (11 columns: chunks 4 + 4 + 3, then 2|2, 2|2, 2|1)
        with pytest.raises(ValueError, match=r"splits a size-11 dim into pieces of \[6, 5\].*split_factor \* 2"):
            check_placements(PlacementSpec([_s(1)]), torch.empty(4, 11), mesh, "parameter 'qkv.weight'")
        with pytest.raises(ValueError, match="out of range for a 0-D tensor"):
            check_placements(PlacementSpec([_s(0)]), torch.empty(()), mesh, "buffer 'step'")


# ------------------------------------------------------------------ local_shard == distribute_tensor
CASES_1D = [
    ((8, 12), [_s(1)]),
    ((24,), [_s(0)]),
    ((5, 12), [_s(1)]),
    ((8, 9), [_s(0, 2)]),
    ((6, 8), [Shard(1)]),
    ((6, 8), [Replicate()]),
]
CASES_2D = [
    ((8, 12), [_s(0, 2), Shard(0)]),  # FSDP2 + TP's right-to-left layout
    ((8, 12), [Shard(0), _s(1)]),
    ((8, 12), [Replicate(), _s(1)]),
    ((6, 12), [_s(1), Shard(0)]),
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_local_shard_matches_distribute_tensor(world_size):
    run_distributed(_local_shard_body, world_size)


def _local_shard_body():
    world = dist.get_world_size()
    cases = [(init_device_mesh("cpu", (world,)), shape, p) for shape, p in CASES_1D]
    if world == 4:
        cases += [(init_device_mesh("cpu", (2, 2)), shape, p) for shape, p in CASES_2D]
    for mesh, shape, placements in cases:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(7))  # the same on every rank
        expected = distribute_tensor(full, mesh, placements).to_local()
        ours = local_shard(full, mesh, tuple(placements))
        what = f"{shape} {placements} on {tuple(mesh.shape)}"
        assert ours.shape == expected.shape and torch.equal(ours, expected), what
        if any(isinstance(p, _StridedShard) for p in placements):  # copied out: the full one can go
            assert ours.untyped_storage().data_ptr() != full.untyped_storage().data_ptr(), what


# ------------------------------------------------------------------ a fused-qkv module, three ways
class Fused(nn.Module):
    def __init__(self, dim: int = 96):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)  # weight (3E, E): rows [q | k | v]
        self.proj = nn.Linear(dim, dim)
        nn.init.normal_(self.qkv.weight, std=0.02)  # re-initialized after its reset: a new generation


PLAN = {"parameter": {"qkv.weight": [_s(0)], "qkv.bias": [_s(0)], "proj.weight": [Shard(1)]}}


@pytest.mark.parametrize("world_size", [2, 4])
def test_strided_plan_deferred_eager_and_presharded_agree(world_size):
    run_distributed(_fused_body, world_size)


def _fused_body():
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("TP",))
    torch.manual_seed(0)
    reference = Fused()
    eager = parallelize_module(copy.deepcopy(reference), mesh, PLAN)
    torch.manual_seed(0)
    net = deferred_init(Fused)
    with TensorMemory() as memory:  # live tensor bytes (see test_dmodule_deferred_init)
        deferred = parallelize_module(net, mesh, PLAN)
    presharded = copy.deepcopy(reference)
    for name, p in presharded.named_parameters():
        p.data = eager.get_parameter(name).to_local().clone()
    presharded = parallelize_module(presharded, mesh, PLAN, is_model_sharded=True)

    for name, ref in reference.named_parameters():
        placements = tuple(PLAN["parameter"].get(name, [Replicate()]))
        expected = distribute_tensor(ref.detach(), mesh, placements).to_local()
        for how, model in (("eager", eager), ("deferred", deferred), ("pre-sharded", presharded)):
            p = model.get_parameter(name)
            assert isinstance(p, DTensor) and p.placements == placements, (how, name, p.placements)
            assert p.shape == ref.shape, (how, name)
            assert torch.equal(p.to_local(), expected), f"{how} {name}: not distribute_tensor's local shard"
            assert torch.equal(p.full_tensor(), ref), f"{how} {name}: not the eager values"
    q, k, v = reference.qkv.weight.detach().chunk(3)
    rows = slice(q.shape[0] // world * dist.get_rank(), q.shape[0] // world * (dist.get_rank() + 1))
    assert torch.equal(deferred.qkv.weight.to_local(), torch.cat([q[rows], k[rows], v[rows]]))

    # only local shards were kept: the full (3E, E) weight never stays, not even briefly beyond its own
    stats = deferred._materialize_stats
    local = sum(t.to_local().numel() * t.element_size() for t in (*deferred.parameters(), *deferred.buffers()))
    assert deferred.qkv.weight.to_local().numel() * world == reference.qkv.weight.numel()
    assert stats.local_bytes == local, stats
    full_qkv = reference.qkv.weight.numel() * reference.qkv.weight.element_size()
    assert stats.largest_full_param_bytes == full_qkv
    assert stats.peak_bytes <= local + full_qkv, stats
    measured = memory.peak_bytes()
    agreement_bytes = 1024  # the ranks' agreement before any collective: a digest per rank, gathered
    assert measured <= local + full_qkv + torch.get_rng_state().numel() + agreement_bytes, (measured, local, full_qkv, stats)
    x = DTensor.from_local(torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(1)), mesh, [Replicate()])
    assert torch.equal(deferred.qkv(x).full_tensor(), eager.qkv(x).full_tensor())  # DTensor computes on it
