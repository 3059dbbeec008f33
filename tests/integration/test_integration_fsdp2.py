"""ZeRO-3 / HSDP with torch's FSDP2 around DModule tensor parallelism, on one (DP=2, TP=2) mesh.

``parallelize_module(model, mesh["TP"], get_plan(...))`` first, then torch's ``fully_shard`` on each
block and on the root over ``mesh["DP"]`` (FSDP2 takes DTensor parameters on the TP submesh of the
same mesh and shards them over DP too). 20 AdamW steps in float64, the loss computed outside the
model against a plain target, equal to one process: every loss and every full parameter.
"""

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from integration_models import batches, build
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import assert_close, distributed

STEPS, BATCH = 20, 8


@pytest.mark.parity
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@distributed(world_size=4, timeout=300)
def test_fsdp2_over_dmodule_tp_matches_one_process(sequence_parallel):
    torch.set_default_dtype(torch.float64)
    DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    reference = build("gpt")
    model = copy.deepcopy(reference)
    model = parallelize_module(model, DEVICE_MESH["TP"], get_plan("nanogpt", model, sequence_parallel=sequence_parallel))
    tp_only = weakref.ref(model.transformer.h[0].mlp.c_fc.weight)
    for block in model.transformer.h:
        fully_shard(block, mesh=DEVICE_MESH["DP"])
    fully_shard(model, mesh=DEVICE_MESH["DP"])
    gc.collect()
    assert tp_only() is None, "a TP-sharded parameter FSDP2 replaced is still held (by the DModule?): no memory saved"
    # every parameter is now sharded over DP too: a DTensor on the whole (DP, TP) mesh
    assert all(isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("DP", "TP") for p in model.parameters())

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    dp_rank, dp_group = DEVICE_MESH.get_data_parallel_rank(), DEVICE_MESH.get_data_parallel_group()
    losses, ref_losses = [], []
    for x, y in batches("gpt", STEPS, BATCH):
        optimizer.zero_grad()
        logits, _ = model(x.chunk(2)[dp_rank])
        loss = F.cross_entropy(logits.flatten(0, 1), y.chunk(2)[dp_rank].flatten())
        loss.backward()  # FSDP2 brings each grad to its TP placement (SP norms' Partial: all-reduced) itself
        optimizer.step()
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean, group=dp_group)
        losses.append(mean / 2)

        ref_optimizer.zero_grad()
        ref_logits, _ = reference(x)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), y.flatten())
        ref_loss.backward()
        ref_optimizer.step()
        ref_losses.append(ref_loss.detach().reshape(1))

    assert_close(torch.cat(losses), torch.cat(ref_losses), name="losses")
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p, ref_params[name], name=name)
