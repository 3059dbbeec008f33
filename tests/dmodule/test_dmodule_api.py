"""The DModule API around the plan: patches, local-head attention, factory mode, errors, dumps,
redistribution logging, pre-sharded models and mesh resolution."""

import re

import pytest
import torch
import torch.nn.functional as F
from core_models import MLP
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndweave.dmodule import DModule, PlacementSpec, log_redistributions, parallelize_module
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.contracts import GradSyncable, mark_removed_modules
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed

R = Replicate()
MLP_TP = {
    "parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)]},
    "forward": {"fc1.input": [[R]], "fc2.output": [[R]]},
}


def _tp_mesh():
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("TP",))


# ------------------------------------------------------------------------------------ attention
class Attention(nn.Module):
    """Causal self-attention written for one device; ``n_head`` is what a TP patch must adjust."""

    def __init__(self, dim=16, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Blocks(nn.Module):
    def __init__(self, num=2):
        super().__init__()
        self.blocks = nn.ModuleList(Attention() for _ in range(num))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _heads_per_rank(module, device_mesh, fqn):
    module.n_head //= device_mesh.size()


LOCAL = PlacementSpec([Shard(-1)], to_local=True)
ATTENTION_PLAN = {
    "parameter": {
        r"blocks\.\d+\.[qkv].weight": [Shard(0)],
        r"blocks\.\d+\.[qkv].bias": [Shard(0)],
        r"blocks\.\d+\.o.weight": [Shard(1)],
    },
    "forward": {
        ".input": [[R]],
        # q/k/v leave as plain local tensors (this rank's heads): CPU SDPA has no DTensor rule
        r"blocks\.\d+\.[qkv].output": [LOCAL],
        r"blocks\.\d+\.o.input": [[Shard(-1)]],
        r"blocks\.\d+\.o.output": [[R]],
    },
    "patch": {"class:Attention": [_heads_per_rank]},
}


def _record_fqn(module, device_mesh, fqn):
    module.patched_as = fqn


@pytest.mark.parity
@pytest.mark.parametrize("world_size", [2, 4])
def test_local_head_attention_and_patches(world_size):
    from ndweave.mesh.testing import run_distributed

    run_distributed(_attention_body, world_size)


def _attention_body():
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    torch.manual_seed(0)
    ref = Blocks()
    torch.manual_seed(0)
    calls = []
    dm = parallelize_module(
        Blocks(), _tp_mesh(), ATTENTION_PLAN,
        patches={r"blocks\.\d+": [_record_fqn], r"blocks\.1\.o": [lambda m, mesh, fqn: calls.append(fqn)]},
    )
    assert [b.n_head for b in dm.blocks] == [4 // dm.device_mesh.size()] * 2
    assert [b.patched_as for b in dm.blocks] == ["blocks.0", "blocks.1"]
    assert calls == ["blocks.1.o"]
    torch.manual_seed(1)
    x = torch.randn(2, 5, 16)
    out, expected = dm(x), ref(x)
    assert_close(out, expected, name="attention output")
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    dm.finish_grad_sync()
    for (name, p), (_, q) in zip(dm.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, name=f"{name}.grad")


def _double_output(module, device_mesh, fqn):
    forward = module.forward
    module.forward = lambda x: 2 * forward(x)


@pytest.mark.parity
@distributed(world_size=2)
def test_patch_may_replace_forward_and_hooks_still_apply():
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    dm = parallelize_module(MLP(), _tp_mesh(), {**MLP_TP, "patch": {"fc2": [_double_output]}})
    # patches run after distribution: the patch saw DTensor parameters
    assert isinstance(dm.fc2.weight, DTensor)
    x = torch.randn(3, 4)
    out = dm(x)
    assert not isinstance(out, DTensor)  # replicated root output: a plain tensor (use_local_output)
    assert_close(out, 2 * ref(x), name="patched output")


# ------------------------------------------------------------------------------------ factory
class MaskedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)  # column-sharded DTensor
        mask = torch.ones(h.shape[-2], h.shape[-1]).tril()  # created in forward, derived op keeps the tag
        return h * mask + torch.arange(h.shape[-1])


@pytest.mark.parity
@distributed(world_size=2)
def test_factory_tensors_become_replicated_dtensors():
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    plan = {"parameter": {"fc.weight": [Shard(0)], "fc.bias": [Shard(0)]}, "forward": {"fc.input": [[R]]}}
    torch.manual_seed(0)
    ref = MaskedLinear()
    x = torch.randn(5, 4)
    torch.manual_seed(0)
    plain = parallelize_module(MaskedLinear(), _tp_mesh(), plan)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        plain(x)
    torch.manual_seed(0)
    dm = parallelize_module(MaskedLinear(), _tp_mesh(), plan, factory=True)
    out = dm(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    assert_close(out, ref(x), name="factory output")
    out.sum().backward()
    ref(x).sum().backward()
    assert_close(dm.fc.weight.grad, ref.fc.weight.grad, name="fc.weight.grad")
    # outside the DModule's forward nothing is intercepted
    assert type(torch.ones(2)) is torch.Tensor and not hasattr(torch.ones(2), "_ndweave_factory")


# ------------------------------------------------------------------------------------ errors
@distributed(world_size=2)
def test_bad_plans_give_actionable_errors():
    mesh = _tp_mesh()
    with pytest.raises(ValueError, match=r"'fc3\.weight' matches nothing.*fc1\.weight"):
        parallelize_module(MLP(), mesh, param_sharding_plan={"fc3.weight": [Shard(0)]})
    with pytest.raises(ValueError, match=r"'fc\.input' matches nothing.*fc1\.input"):
        parallelize_module(MLP(), mesh, fwd_resharding_plan={"fc.input": [[R]]})
    with pytest.raises(ValueError, match=r"'fc1.weight'.*Shard\(dim=2\) is out of range.*DeviceMesh\(cpu"):
        parallelize_module(MLP(), mesh, param_sharding_plan={"fc1.weight": [Shard(2)]})
    with pytest.raises(ValueError, match=r"'fc2.bias'.*2 placements.*1-D mesh.*DeviceMesh\(cpu, \{'TP': 2\}\)"):
        parallelize_module(MLP(), mesh, param_sharding_plan={"fc2.bias": [Shard(0), R]})
    with pytest.raises(ValueError, match=r"'fc1.input'.*2 placements.*1-D mesh"):
        parallelize_module(MLP(), mesh, fwd_resharding_plan={"fc1.input": [[R, R]]})
    with pytest.raises(ValueError, match=r"patch plan key 'class:Linnear' matches nothing.*class:Linear"):
        parallelize_module(MLP(), mesh, patches={"class:Linnear": [_record_fqn]})
    with pytest.raises(ValueError, match=r"patch plan key 'fc9' matches nothing"):
        parallelize_module(MLP(), mesh, patches={"fc9": [_record_fqn]})
    with pytest.raises(TypeError, match=r"one placements list per input"):
        parallelize_module(MLP(), mesh, fwd_resharding_plan={"fc1.input": [R]})
    with pytest.raises(ValueError, match="unknown section 'params'; did you mean 'parameter'"):
        parallelize_module(MLP(), mesh, {"params": {}})
    with pytest.raises(ValueError, match=r"'fc1.weight' is on the meta device.*deferred_init"):
        parallelize_module(MLP().to("meta"), mesh, MLP_TP)


@distributed(world_size=2)
def test_plan_keys_naming_modules_a_pipeline_stage_removed_are_skipped():
    # a pipeline stage: fc2 lives on another stage; an identity stands in its slot and the root records it
    torch.set_default_dtype(STRICT_DTYPE)
    stage = MLP()
    stage.fc2 = nn.Identity()
    mark_removed_modules(stage, {"fc2": "Linear"})
    # "fc2\.inner": a module inside the removed one (a block's experts on a stage without blocks)
    plan = {**MLP_TP, "patch": {"fc2": [_record_fqn], r"fc2\.inner": [_record_fqn], "class:Linear": [_record_fqn]}}
    dstage = parallelize_module(stage, _tp_mesh(), plan)
    assert isinstance(dstage.fc1.weight, DTensor) and not list(dstage.fc2.parameters())
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))  # the same on every rank
    assert dstage.fc1.patched_as == "fc1"
    assert_close(dstage(x), torch.relu(F.linear(x, dstage.fc1.weight.full_tensor(), dstage.fc1.bias.full_tensor())))
    with pytest.raises(ValueError, match=r"'fc3\.weight' matches nothing"):  # typos still fail
        parallelize_module(mark_removed_modules(MLP(), {"fc2": "Linear"}), _tp_mesh(), param_sharding_plan={"fc3.weight": [R]})


# ------------------------------------------------------------------------------------ debugging
@distributed(world_size=2)
def test_dmodule_class_dump_plan_and_redistribution_log():
    mlp = MLP()
    dm = parallelize_module(mlp, _tp_mesh(), MLP_TP)
    assert dm is mlp and isinstance(dm, DModule) and isinstance(dm, MLP) and isinstance(dm, GradSyncable)
    assert type(dm).__name__ == "DModuleMLP" and "finish_grad_sync" not in dm.__dict__
    assert not isinstance(dm.fc1, DModule)  # only the root changes class
    table = dm.dump_plan()
    rows = {line.split()[0]: line for line in table.splitlines()[2:-1]}
    assert re.search(r"param\s+Shard\(dim=0\)\s+\(8, 4\)\s+\(4, 4\)\s+64$", rows["fc1.weight"]), rows["fc1.weight"]
    assert re.search(r"param\s+Shard\(dim=1\)\s+\(4, 8\)\s+\(4, 4\)\s+64$", rows["fc2.weight"]), rows["fc2.weight"]
    assert re.search(r"param\s+Replicate\(\)\s+\(4,\)\s+\(4,\)\s+16$", rows["fc2.bias"]), rows["fc2.bias"]
    assert "local total 160 bytes" in table
    x = torch.randn(3, 4)
    with log_redistributions() as lines:
        dm(x)
    assert lines == [
        "fc1.input[0]: ('local',) -> (Replicate(),) shape (3, 4) (from_local)",
        "fc2.output[0]: (Partial(sum),) -> (Replicate(),) shape (3, 4)",
    ], lines
    dm(x)  # logging is off again
    assert len(lines) == 2


@distributed(world_size=2)
def test_a_layout_counted_from_the_end_is_no_redistribution():
    """``Shard(-1)`` asked of a value already ``Shard(1)`` (the features of a 2-D activation, as plans
    write them): nothing in the log, no redistribution in the autograd graph, the same numbers."""
    plan = {**MLP_TP, "forward": {**MLP_TP["forward"], "fc1.output": [[Shard(-1)]]}}
    dm = parallelize_module(MLP(), _tp_mesh(), plan)
    x = torch.randn(3, 4)
    with log_redistributions() as lines:
        hidden = dm.fc1(DTensor.from_local(x, dm.fc1.weight.device_mesh, [R]))
    assert lines == [], lines
    assert hidden.placements == (Shard(1),) and "Redistribute" not in type(hidden.grad_fn).__name__, hidden.grad_fn
    with log_redistributions() as lines:
        dm(x)
    assert len(lines) == 2 and not any(line.startswith("fc1.output") for line in lines), lines


@distributed(world_size=2)
def test_list_grad_sync_shows_pending_then_synced():
    plan = {"forward": {".input": [[Shard(0)]]}}  # data-sharded input, replicated weights: Partial grads
    dm = parallelize_module(nn.Linear(4, 3), _tp_mesh(), plan)
    assert dm.list_grad_sync() == []
    dm(torch.randn(2, 4)).sum().backward()
    pending = dm.list_grad_sync()
    # (the linear runs on local shards: both grads are sums over the sharded batch dim, reduced together)
    assert sorted((e.fqn, e.status) for e in pending) == [("bias", "pending"), ("weight", "pending")]
    assert all(e.placements[0].is_partial() for e in pending)
    grads = dict(pending)  # veScale's (fqn, grad) pairs
    assert grads["weight"] is dm.weight.grad and grads["bias"] is dm.bias.grad
    dm.finish_grad_sync()
    assert sorted((e.fqn, e.status) for e in dm.list_grad_sync()) == [("bias", "synced"), ("weight", "synced")]
    assert dm.weight.grad.placements == dm.bias.grad.placements == (R,)
    assert dict(dm.list_grad_sync())["weight"] is dm.weight.grad
    dm.finish_grad_sync()  # twice is harmless


# ------------------------------------------------------------------------------------ inputs
@pytest.mark.parity
@distributed(world_size=2)
def test_presharded_model_and_mesh_resolution():
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    torch.manual_seed(0)
    ref = MLP(4, 6)
    # is_model_sharded: each rank already holds its shard (hidden 6 -> 3 per rank)
    rank = torch.distributed.get_rank()
    local = MLP(4, 6)
    with torch.no_grad():
        local.fc1.weight = nn.Parameter(ref.fc1.weight[3 * rank: 3 * rank + 3].clone())
        local.fc1.bias = nn.Parameter(ref.fc1.bias[3 * rank: 3 * rank + 3].clone())
        local.fc2.weight = nn.Parameter(ref.fc2.weight[:, 3 * rank: 3 * rank + 3].clone())
        local.fc2.bias = nn.Parameter(ref.fc2.bias.clone())
    # the default mesh's TP dim (device_mesh=None)
    DEVICE_MESH.init_device_mesh("cpu", (1, 2), mesh_dim_names=("DP", "TP"))
    dm = parallelize_module(local, None, MLP_TP, is_model_sharded=True)
    assert dm.device_mesh.mesh_dim_names == ("TP",)
    assert dm.fc1.weight.shape == (6, 4) and dm.fc1.weight.to_local().shape == (3, 4)
    x = torch.randn(3, 4)
    assert_close(dm(x), ref(x), name="pre-sharded output")
    # a ParallelMesh means its TP dim
    dm2 = parallelize_module(MLP(4, 6), DEVICE_MESH, MLP_TP)
    assert dm2.device_mesh.mesh_dim_names == ("TP",)


@pytest.mark.parity
@distributed(world_size=2)
def test_inputs_by_name_and_none_entries():
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, scale=None, tag="t"):
            return self.fc(x) * scale

    torch.manual_seed(0)
    dm = parallelize_module(Two(), _tp_mesh(), {
        "parameter": {"fc.weight": [Shard(0)]},
        "forward": {".input": {"x": [R], "scale": [R]}, "fc.output": [PlacementSpec([R], async_op=True)]},
    })
    x, s = torch.randn(2, 4), torch.randn(2, 4)
    out_pos, out_kw = dm(x, s), dm(x, scale=s)
    assert torch.equal(out_pos, out_kw)
    torch.manual_seed(0)
    ref = Two()
    assert_close(out_pos, ref(x, s), name="output with inputs by name")


@pytest.mark.parity
@distributed(world_size=2)
def test_forward_plan_weight_is_redistributed_before_forward():
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    plan = {
        "parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(0)]},
        # fc2 computes with a gathered weight: its input must be replicated, its output stays so
        "forward": {"fc1.input": [[R]], "fc2.input": [[R]], "fc2.weight": [R]},
    }
    dm = parallelize_module(MLP(), _tp_mesh(), plan)
    x = torch.randn(3, 4)
    with log_redistributions() as lines:
        out = dm(x)
    assert "fc2.weight: (Shard(dim=0),) -> (Replicate(),) shape (4, 8)" in lines, lines
    assert "weight" not in dm.fc2.__dict__  # the gathered weight lives only during forward
    assert_close(out, ref(x), name="output")
    out.sum().backward()
    ref(x).sum().backward()
    dm.finish_grad_sync()
    assert dm.fc2.weight.grad.placements == (Shard(0),)
    for (name, p), (_, q) in zip(dm.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, name=f"{name}.grad")
