"""get_plan("auto") composes like a zoo plan: transformers models on DP=2 x TP=2 with DDP and
DistributedOptimizer (AdamW, ZeRO-1) train like one process in float64."""

import copy

import pytest
import torch
from test_integration_hf import _build, _train

from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed
from ndweave.optim import DistributedOptimizer

STEPS, BATCH, SEQ = 3, 4, 8


@pytest.mark.parity
@pytest.mark.parametrize("name,sp", [("hf_llama", True), ("hf_gpt2", False)])
@distributed(world_size=4, timeout=300)
def test_auto_plan_dp_tp_zero_adamw_matches_one_process(name, sp):
    DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    torch.set_default_dtype(STRICT_DTYPE)
    reference = _build(name)
    model = copy.deepcopy(reference)
    model = parallelize_module(model, DEVICE_MESH["TP"], get_plan("auto", model, sequence_parallel=sp))
    model = DDP(model, DEVICE_MESH["DP"], use_distributed_optimizer=True, bucket_size=20_000)
    # eps well above rounding noise: a gradient that is zero in exact arithmetic (a key bias under
    # softmax) is pure noise that Adam would otherwise blow up to a full step
    kwargs = {"lr": 1e-2, "eps": 1e-4, "foreach": False}
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=[model], optimizer_kwargs=kwargs)
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, reference.config.vocab_size, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    losses = _train(model, optimizer, data, DEVICE_MESH.get_data_parallel_rank(), DEVICE_MESH.get_data_parallel_group())
    ref_losses = _train(reference, torch.optim.AdamW(reference.parameters(), **kwargs), data)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), name="losses")
    for (fqn, p), (_, q) in zip(reference.named_parameters(), model.module.named_parameters()):
        assert_close(q, p, name=f"{fqn} after {STEPS} AdamW steps")
