"""CUDA/NCCL smoke tests: the same mesh code on GPUs. Skipped where fewer than 2 GPUs are visible."""

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import run_distributed

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def _nccl_mesh_roundtrip():
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("DP",))
    t = torch.ones(3, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t, group=mesh.get_group("DP"))
    return dist.get_backend(), t.device.index, t.tolist()


@needs_two_gpus
def test_nccl_mesh_on_two_gpus():
    results = run_distributed(_nccl_mesh_roundtrip, 2, device_type="cuda")
    assert [r[0] for r in results] == ["nccl", "nccl"]
    assert [r[1] for r in results] == [0, 1]  # each rank on its own device
    assert all(r[2] == [3.0, 3.0, 3.0] for r in results)
