"""Bad arguments to DDP: a clear error naming the argument and the fix, on every rank alike, before
any collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_cases import MLP
from ndweave.ddp import DDP
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import distributed


@distributed(world_size=2)
def test_bucket_size_must_be_a_positive_number_of_elements():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("DP",))["DP"]
    for bad in (0, -5, "32MB", 1.5, True):
        with pytest.raises(ValueError, match=r"bucket_size must be a positive int.*bucket_size=8_000_000"):
            DDP(MLP(), mesh, bucket_size=bad)
    assert len(DDP(MLP(), mesh, bucket_size=64).grad_buckets()) > 1


@distributed(world_size=2)
def test_parameters_on_the_meta_device_are_refused_with_how_to_materialize():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("DP",))["DP"]
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(ValueError, match=r"\['fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias'\] and 2 more "
                                         r"are on the meta device.*to_empty"):
        DDP(model, mesh)
    model.to_empty(device="cpu")
    for m in (model.fc1, model.fc2, model.head):
        m.reset_parameters()
    DDP(model, mesh)


def _one_rank_differs(model: MLP, rank: int, change: str) -> tuple[MLP, dict]:
    """``model`` as DP rank 1 might build it by mistake (``change``), and DDP's other arguments."""
    if rank != 1:
        return model, {}
    if change == "shape":
        model.head = torch.nn.Linear(12, 4, dtype=model.head.weight.dtype)  # a config read per rank
    elif change == "extra module":
        model.extra = torch.nn.Linear(3, 3)
    elif change == "frozen":
        model.fc1.bias.requires_grad_(False)
    elif change == "order":  # the same modules registered in another order: other buckets
        model._modules = dict(reversed(list(model._modules.items())))
    elif change == "bucket_size":
        return model, {"bucket_size": 64}
    return model, {}


@pytest.mark.parametrize("change, named", [
    ("shape", r"parameter 'head.weight': shape \[4, 12\].* there, shape \[3, 12\]"),
    ("extra module", r"parameter 'extra.weight': shape \[3, 3\].* there, <absent>"),
    ("frozen", r"parameter 'fc1.bias'.*not synced there, .*synced on rank 0"),
    ("order", r"the same entries in another order"),
    ("bucket_size", r"argument bucket_size: 64 there, 8388608 on rank 0"),
])
@distributed(world_size=2)
def test_a_rank_that_wraps_another_model_raises_on_every_rank_before_the_broadcast(change, named):
    # before: rank 1 received rank 0's parameters cut short (silently), or gloo aborted it (SIGABRT)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("DP",))["DP"]
    model, arguments = _one_rank_differs(MLP(), dist.get_rank(), change)
    with pytest.raises(ValueError, match=r"DDP: rank 1 \(DP rank 1\) wraps another model, or passes other "
                                         r"arguments, than rank 0 \(DP rank 0\): " + named):
        DDP(model, mesh, **arguments)
    DDP(MLP(), mesh)  # the ranks are still in step


@distributed(world_size=2)
def test_unsupported_zero_stages_are_refused_on_every_rank_with_the_fix():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("DP",))["DP"]
    with pytest.raises(ValueError, match=r"(?s)ranks 0, 1: zero_stage=3 is not 0, 1 or 2\. .*FSDP.*fully_shard"):
        DDP(MLP(), mesh, zero_stage=3)
    with pytest.raises(ValueError, match=r"use_distributed_optimizer=False contradicts zero_stage=2"):
        DDP(MLP(), mesh, zero_stage=2, use_distributed_optimizer=False)
    # one rank alone asking for a stage DDP lacks: the others raise it too, naming that rank
    with pytest.raises(ValueError, match=r"(?s)rank 1: zero_stage=4 is not 0, 1 or 2.*DDP takes zero_stage=0"):
        DDP(MLP(), mesh, zero_stage=4 if dist.get_rank() == 1 else 2)
    assert DDP(MLP(), mesh, zero_stage=2).use_distributed_optimizer  # the ranks are still in step
    assert DDP(MLP(), mesh, use_distributed_optimizer=True).zero_stage == 1
