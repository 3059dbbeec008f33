"""get_plan("auto") composes like a zoo plan: transformers models on DP=2 x TP=2 with DDP and
DistributedOptimizer (AdamW, ZeRO-1) train like one process in float64: the zoo's two families, and
every family the automatic-plan issue names (heavy), built from the tiny configs of the dmodule
tests' architecture suite."""

import copy

import pytest
import torch
from dmodule.dmodule_auto_models import FLOAT32_INSIDE, FLOAT32_ROUTING, build_hf
from test_integration_hf import _build, _train

from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import STRICT, STRICT_DTYPE, Tolerance, assert_close, distributed
from ndweave.optim import DistributedOptimizer

STEPS, BATCH, SEQ = 3, 4, 8
#: transformers' decoder families the automatic-plan issue names (Llama and GPT-2 run above, from the
#: zoo's fixtures); the MoE ones route in float32 whatever the dtype (see FLOAT32_INSIDE)
NAMED = ["qwen2", "mistral", "phi3", "gpt_neox", "falcon", "opt", *sorted(FLOAT32_ROUTING)]


@pytest.mark.parity
@pytest.mark.parametrize("name,sp", [("hf_llama", True), ("hf_gpt2", False)])
@distributed(world_size=4, timeout=300)
def test_auto_plan_dp_tp_zero_adamw_matches_one_process(name, sp):
    torch.set_default_dtype(STRICT_DTYPE)
    _check_dp_tp_adamw(_build(name), sp, STRICT)


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("arch", NAMED)
@distributed(world_size=4, timeout=300)
def test_named_families_dp_tp_sp_zero_adamw_match_one_process(arch):
    """With sequence parallel (TP alone is the same plan less the sequence shards; the dmodule
    tests run both modes on every family)."""
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    tol = FLOAT32_INSIDE if arch in FLOAT32_ROUTING else STRICT
    _check_dp_tp_adamw(build_hf(arch).eval(), True, tol)  # eval: no dropout; grads flow the same


def _check_dp_tp_adamw(reference: torch.nn.Module, sp: bool, tol: Tolerance) -> None:
    DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
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
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), name="losses", tol=tol)
    for (fqn, p), (_, q) in zip(reference.named_parameters(), model.module.named_parameters()):
        assert_close(q, p, name=f"{fqn} after {STEPS} AdamW steps", tol=tol)
