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
