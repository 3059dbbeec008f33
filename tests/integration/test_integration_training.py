"""DModule (TP/SP) + DDP + optimizer on one (DP=2, TP=2) mesh, trained 20 steps, against one process
(both in float64, strict tolerance). The GPT job's own parity tests: ``test_integration_gpt_job.py``.

This is the seed's loop as users write it: ``zero_grad(); loss.backward(); step()`` with no other call.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from integration_models import batches, build, loss_of, train_reference
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed, full_tensor
from ndweave.optim import BasicOptimizer, DistributedOptimizer

STEPS, BATCH = 20, 8
SEED_MLP_PLAN = {
    "parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)], "fc2.bias": [Replicate()]},
    "forward": {"fc1.input": [[Replicate()]], "fc2.output": [[Replicate()]],
                # this MLP takes the loss in forward: its target joins the mesh too (root FQN is "")
                ".input": [None, [Replicate()]]},
}


def _plan(kind, model):
    if kind == "mlp":
        return SEED_MLP_PLAN
    return get_plan("nanogpt", model, sequence_parallel=(kind == "nanogpt_sp"))


@pytest.mark.parity
@pytest.mark.parametrize("kind", ["mlp", "nanogpt", "nanogpt_sp"])
@pytest.mark.parametrize("optim", ["zero", "zero_overlap", "basic", "torch"])
@distributed(world_size=4, timeout=240)
def test_seed_loop_matches_one_process(kind, optim):
    DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(2, 2), mesh_dim_names=("DP", "TP"))
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    reference = build(kind)
    model = copy.deepcopy(reference)
    opt_cls, opt_kwargs, clip = torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, 0.5

    # the seed's composition
    if DEVICE_MESH.get_strategy_size("TP") > 1:
        model = parallelize_module(model, DEVICE_MESH["TP"], _plan(kind, model))
    sharded = optim.startswith("zero")
    model = DDP(model, DEVICE_MESH["DP"], use_distributed_optimizer=sharded, bucket_size=500)
    if sharded:
        optimizer = DistributedOptimizer(opt_cls, models=[model], clip_grad=clip,
                                         overlap_param_gather=optim == "zero_overlap", optimizer_kwargs=opt_kwargs)
    elif optim == "basic":
        optimizer = BasicOptimizer(opt_cls, models=[model], clip_grad=clip, optimizer_kwargs=opt_kwargs)
    else:  # a plain torch optimizer: the user finishes the grad sync and clips themselves
        optimizer = opt_cls(model.parameters(), **opt_kwargs)

    data = batches("mlp" if kind == "mlp" else "gpt", STEPS, BATCH)
    dp_rank, dp_group = DEVICE_MESH.get_data_parallel_rank(), DEVICE_MESH.get_data_parallel_group()
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_of(model(x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]))
        loss.backward()
        if optim == "torch":
            model.finish_grad_sync()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        local = full_tensor(loss).reshape(1)
        dist.all_reduce(local, group=dp_group)
        losses.append(local.item() / 2)

    ref_losses = train_reference(reference, data, opt_cls, opt_kwargs, clip)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), name="losses")
    ref_params = dict(reference.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(ref_params), "DDP/DModule changed the parameter names"
    for name, p in model.named_parameters():
        assert_close(p, ref_params[name], name=name)


@pytest.mark.parity
@pytest.mark.parametrize("optim", ["zero", "basic"])
@distributed(world_size=2, timeout=120)
def test_pure_data_parallel_norm_needs_no_collective(optim):
    """DP alone on gloo: DDP all-reduces whole buckets (ZeRO-1 too), so the optimizer clips by a norm each
    rank takes itself: no all-reduce in step(), and the same training as one process."""
    DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(2,), mesh_dim_names=("DP",))
    torch.set_default_dtype(STRICT_DTYPE)
    reference = build("mlp")
    model = DDP(copy.deepcopy(reference), DEVICE_MESH["DP"], use_distributed_optimizer=optim == "zero", bucket_size=500)
    opt_cls, opt_kwargs, clip = torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, 0.5
    cls = DistributedOptimizer if optim == "zero" else BasicOptimizer
    optimizer = cls(opt_cls, models=[model], clip_grad=clip, optimizer_kwargs=opt_kwargs)
    data, dp_rank = batches("mlp", STEPS, BATCH), dist.get_rank()
    all_reduces = 0
    for x, y in data:
        optimizer.zero_grad()
        loss_of(model(x.chunk(2)[dp_rank], y.chunk(2)[dp_rank])).backward()
        with CommDebugMode() as comms:  # (the grad sync finished in backward: what is left is the step's)
            optimizer.step()
        all_reduces += comms.get_comm_counts().get(torch.ops.c10d.allreduce_, 0)
    assert not all_reduces, f"{all_reduces} all-reduces in {STEPS} steps"
    train_reference(reference, data, opt_cls, opt_kwargs, clip)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p, ref_params[name], name=name)
