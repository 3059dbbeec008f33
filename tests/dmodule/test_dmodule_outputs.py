"""What leaves the parallelized root module, and which mesh it runs on: replicated outputs come back
as plain tensors (``use_local_output=True``, torch TP's default), so a loss computed outside the
model meets a plain target; a ``ParallelMesh`` without a "TP" dim is refused with the fix named."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from core_models import MLP
from dmodule_training import check_training_parity
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndweave.dmodule import parallelize_module
from ndweave.dmodule.plans import get_plan
from ndweave.mesh import DEVICE_MESH, init_device_mesh as init_parallel_mesh
from ndweave.mesh.testing import assert_close, distributed

R = Replicate()


def _tp_mesh():
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("TP",))


def _mse(net, batch):
    x, y = batch
    out = net(x)
    assert type(out) is torch.Tensor, type(out)  # fc2's Replicate output, handed back plain
    return F.mse_loss(out, y)


@pytest.mark.parity
@distributed(world_size=2)
def test_replicated_output_meets_a_plain_target():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    ref = MLP(4, 8)
    model = parallelize_module(copy.deepcopy(ref), _tp_mesh(), get_plan("mlp", ref))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)) for _ in range(3)]
    check_training_parity(model, ref, batches, _mse)


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "kept"


class ManyOutputs(nn.Module):
    """Outputs nested in a tuple, a dict and a dataclass; some replicated, one sharded."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)  # colwise: a Shard(-1) output
        self.fc2 = nn.Linear(8, 4)  # rowwise, reduced: a Replicate output

    def forward(self, x):
        hidden = self.fc1(x)
        out = self.fc2(torch.relu(hidden))
        return out, {"out": out, "both": [out, hidden]}, Result(logits=out, hidden=hidden)


@pytest.mark.parity
@distributed(world_size=2)
def test_nested_outputs_only_replicated_ones_become_plain():
    torch.set_default_dtype(torch.float64)
    plan = {"parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)]},
            "forward": {"fc1.input": [[R]], "fc2.output": [[R]]}}
    torch.manual_seed(0)
    ref = ManyOutputs()
    model = parallelize_module(copy.deepcopy(ref), _tp_mesh(), plan)
    x = torch.randn(3, 4)
    out, nested, result = model(x)
    plain = [out, nested["out"], nested["both"][0], result.logits]
    assert all(type(t) is torch.Tensor for t in plain), [type(t) for t in plain]
    # a sharded output stays a DTensor: its plain local shard would silently meet a full target
    for hidden in (nested["both"][1], result.hidden):
        assert isinstance(hidden, DTensor) and hidden.placements == (Shard(1),)
    assert isinstance(result, Result) and result.note == "kept"
    ref_out, _, ref_result = ref(x)
    (out.sum() + result.logits.pow(2).sum() + result.hidden.full_tensor().sum()).backward()
    (ref_out.sum() + ref_result.logits.pow(2).sum() + ref_result.hidden.sum()).backward()
    assert_close(out, ref_out, name="output")
    for name, p in model.named_parameters():  # gradients through the plain outputs are exact
        assert_close(p.grad, ref.get_parameter(name).grad, name=f"{name}.grad")

    kept = parallelize_module(ManyOutputs(), _tp_mesh(), plan, use_local_output=False)(x)
    assert isinstance(kept[0], DTensor) and kept[0].placements == (R,)
    assert isinstance(kept[2].logits, DTensor)


@distributed(world_size=4)
def test_parallel_mesh_without_tp_dim_is_refused_with_the_fix():
    mesh = init_parallel_mesh("cpu", (2, 2), mesh_dim_names=("DP", "PP"))
    with pytest.raises(ValueError, match=r"the ParallelMesh passed has dims \['DP', 'PP'\] and no 'TP' dim.*"
                                         r"mesh\[\"<dim>\"\] \(e.g. mesh\['PP'\]\), or a DeviceMesh"):
        parallelize_module(MLP(), mesh, get_plan("mlp"))
    DEVICE_MESH.init_device_mesh("cpu", (4,), mesh_dim_names=("DP",))
    with pytest.raises(ValueError, match=r"the default DEVICE_MESH has dims \['DP'\] and no 'TP' dim"):
        parallelize_module(MLP(), None, get_plan("mlp"))
    # the fixes the message names both work
    assert parallelize_module(MLP(), mesh["PP"], get_plan("mlp")).device_mesh.mesh_dim_names == ("PP",)
    whole = parallelize_module(MLP(), mesh.device_mesh, {"parameter": {"fc1.weight": [Shard(0), Shard(1)]}})
    assert whole.device_mesh.mesh_dim_names == ("DP", "PP")
