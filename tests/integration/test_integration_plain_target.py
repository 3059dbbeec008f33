"""The loss users write: computed OUTSIDE the model, against a plain target, on DP=2 x TP=2.

``F.mse_loss(model(x), y)`` for the seed's MLP (its plan leaves the output ``Replicate``, which
leaves the model as a plain tensor) and ``F.cross_entropy(logits.flatten(0, 1), y.flatten())`` for
nanoGPT, with DModule + DDP + the sharded DistributedOptimizer or the BasicOptimizer: 20 AdamW steps
in float64, equal to one process.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from integration_models import batches, build
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import assert_close, distributed
from ndweave.optim import BasicOptimizer, DistributedOptimizer

STEPS, BATCH = 20, 8
CLIP = 0.5  # low enough that clipping acts on most steps
SEED_MLP_PLAN = {  # the seed's plan: fc2's output is Replicate
    "parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)], "fc2.bias": [Replicate()]},
    "forward": {"fc1.input": [[Replicate()]], "fc2.output": [[Replicate()]]},
}


class MLP(nn.Module):
    """The seed's MLP, returning its output (the loss is the user's business)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def _loss(kind, model, x, y):
    if kind == "mlp":
        return F.mse_loss(model(x), y)
    logits, _ = model(x)  # nanoGPT without targets: (logits, None)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parity
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("optim", ["zero", "basic"])
@distributed(world_size=4, timeout=300)
def test_loss_outside_the_model_matches_one_process(kind, optim):
    torch.set_default_dtype(torch.float64)
    DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(2, 2), mesh_dim_names=("DP", "TP"))
    if kind == "mlp":
        torch.manual_seed(0)
        reference = MLP()
    else:
        reference = build("gpt")
    model = copy.deepcopy(reference)
    plan = SEED_MLP_PLAN if kind == "mlp" else get_plan("nanogpt", model)
    model = parallelize_module(model, DEVICE_MESH["TP"], plan)
    sharded = optim == "zero"
    model = DDP(model, DEVICE_MESH["DP"], use_distributed_optimizer=sharded, bucket_size=500)
    opt_kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    if sharded:
        optimizer = DistributedOptimizer(torch.optim.AdamW, models=[model], clip_grad=CLIP, optimizer_kwargs=opt_kwargs)
    else:
        optimizer = BasicOptimizer(torch.optim.AdamW, models=[model], clip_grad=CLIP, optimizer_kwargs=opt_kwargs)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), **opt_kwargs)

    dp_rank, dp_group = DEVICE_MESH.get_data_parallel_rank(), DEVICE_MESH.get_data_parallel_group()
    losses, ref_losses = [], []
    for x, y in batches(kind, STEPS, BATCH):
        optimizer.zero_grad()
        loss = _loss(kind, model, x.chunk(2)[dp_rank], y.chunk(2)[dp_rank])
        assert type(loss) is torch.Tensor  # the model's output met the plain target: no DTensor left
        loss.backward()
        optimizer.step()
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean, group=dp_group)
        losses.append(mean / 2)

        ref_optimizer.zero_grad()
        ref_loss = _loss(kind, reference, x, y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        ref_optimizer.step()
        ref_losses.append(ref_loss.detach().reshape(1))

    assert_close(torch.cat(losses), torch.cat(ref_losses), name="losses")
    ref_params = dict(reference.named_parameters())
    assert sorted(n for n, _ in model.named_parameters()) == sorted(ref_params)
    for name, p in model.named_parameters():
        assert_close(p, ref_params[name], name=name)
