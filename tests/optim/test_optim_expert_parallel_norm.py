"""The global grad norm counts each element once when a bucket is reduced over a group wider than a
DTensor param's ``Replicate`` dim: with expert parallelism a dense param replicated over EP sits in a
DP x EP bucket, whose ranks own disjoint ranges of it, so the EP ranks past the first must count
their ranges too (``grad_norm.counts_replica`` skips a mesh dim whose group lies within the bucket's)."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import STRICT, STRICT_DTYPE, ReferenceDataParallel, assert_close, distributed
from ndweave.mesh.torch_compat import flatten_mesh
from ndweave.optim import DistributedOptimizer


@distributed(world_size=4)
def test_a_param_replicated_over_ep_in_a_dp_x_ep_bucket_counts_once():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "EP"))
    torch.manual_seed(0)
    reference = torch.nn.Linear(40, 30, dtype=STRICT_DTYPE)  # 1230 elements: every rank owns a range
    layer = copy.deepcopy(reference)
    for name, p in list(layer.named_parameters()):  # replicated over EP, as a DModule on an EP mesh holds them
        setattr(layer, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh["EP"], [Replicate()])))
    model = ReferenceDataParallel(layer, flatten_mesh(mesh.device_mesh, "DP_EP_norm"), use_distributed_optimizer=True)
    opt = DistributedOptimizer(torch.optim.SGD, [model], optimizer_kwargs={"lr": 0.1})
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(1), dtype=STRICT_DTYPE)  # the same on every rank
    opt.zero_grad()
    model(DTensor.from_local(x, mesh["EP"], [Replicate()])).to_local().square().sum().backward()
    grads = torch.autograd.grad(reference(x).square().sum(), list(reference.parameters()))
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    assert_close(opt.clip_grad_norm(1e9), expected, name="global grad norm", tol=STRICT)
