"""Context parallel composed with data parallel: the GPT at DP=2 x CP=2, ndweave's DDP over the
DP x CP ranks (flattened: CP ranks split the tokens as DP ranks split the rows, so their grads are
averaged alike) and the DistributedOptimizer (ZeRO-1 and ZeRO-2) stepping AdamW, against one process
in float64, every parameter after every step."""

from __future__ import annotations

import pytest

from ndweave.mesh.testing import run_distributed


@pytest.mark.parity
@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("data_mesh", ["mesh", "flattened"])
def test_dp2_by_cp2_with_zero_trains_like_one_process(zero_stage, data_mesh):
    """DDP given the mesh (its data dims: DP and CP), or DP x CP flattened by hand."""
    run_distributed(_dp_cp_zero, 4, zero_stage, data_mesh, timeout=300)


def _dp_cp_zero(zero_stage: int, data_mesh: str) -> None:
    import copy

    import torch

    from ndweave.ddp import DDP
    from ndweave.dmodule.context import ContextParallel
    from ndweave.mesh import init_device_mesh
    from ndweave.mesh.testing import assert_close, train_one_process
    from ndweave.optim import DistributedOptimizer
    from ndweave_gpt.models.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    seq = 16
    reference = GPT(GPTConfig(vocab_size=64, block_size=seq, n_layer=2, n_head=4, n_embd=32, dropout=0.0)).double()
    generator = torch.Generator().manual_seed(0)
    batches = [(ids, torch.roll(ids, -1, dims=1)) for ids in torch.randint(0, 64, (3, 4, seq), generator=generator)]
    adamw = {"lr": 1e-2, "eps": 1e-4, "foreach": False}
    expected = train_one_process(reference, batches, optimizer=lambda ps: torch.optim.AdamW(ps, **adamw),
                                 model_loss=lambda m, x, y: m(x, y)[1], copy_model=True, keep_params="every")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "CP"))
    cp = ContextParallel(mesh)
    over, dim = (mesh, "DP") if data_mesh == "mesh" else (mesh.flatten(("DP", "CP"), "DP_CP"), "DP_CP")
    model = DDP(copy.deepcopy(reference), over, dim=dim, zero_stage=zero_stage, bucket_size=4_000)  # (several buckets)
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=[model], optimizer_kwargs=adamw)
    dp = mesh["DP"].get_local_rank()
    for step, (ids, targets) in enumerate(batches):
        rows, row_targets = ids.chunk(2)[dp], targets.chunk(2)[dp]
        with cp.attention():
            _, loss = model(cp.shard(rows), cp.shard(row_targets), position_ids=cp.position_ids(seq))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for name, p in model.module.named_parameters():
            assert_close(p, expected.params[step][name], name=f"step {step} {name}")


@pytest.mark.parity
def test_cp2_by_ep2_on_mixtral_trains_like_one_process():
    """transformers' Mixtral, its experts divided over EP=2 and each sequence over CP=2: EP ranks take
    other rows, CP ranks other tokens of them; DDP given the mesh reduces dense grads over CP x EP and
    the experts' over CP (ZeRO-1, AdamW), against one process (to the float32 bound of Mixtral's
    float32 routing)."""
    run_distributed(_cp_ep_mixtral, 4, timeout=300)


def _cp_ep_mixtral() -> None:
    import copy

    import torch
    import torch.nn.functional as F
    from transformers import MixtralConfig, MixtralForCausalLM

    from ndweave.ddp import DDP
    from ndweave.dmodule import get_plan, parallelize_module
    from ndweave.dmodule.context import ContextParallel
    from ndweave.mesh import init_device_mesh
    from ndweave.mesh.testing import Tolerance, assert_close, train_one_process
    from ndweave.optim import DistributedOptimizer

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    seq = 16
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation, config._attn_implementation = "eager", "sdpa"
    reference = MixtralForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    batches = [(ids, torch.roll(ids, -1, dims=1)) for ids in torch.randint(0, 64, (2, 4, seq), generator=generator)]
    adamw = {"lr": 1e-2, "eps": 1e-4, "foreach": False}
    loss_of = lambda m, x, y, **kw: F.cross_entropy(m(input_ids=x, **kw).logits.flatten(0, 1), y.flatten())  # noqa: E731
    expected = train_one_process(reference, batches, optimizer=lambda ps: torch.optim.AdamW(ps, **adamw),
                                 model_loss=loss_of, copy_model=True, keep_params="every")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("CP", "EP"))
    cp = ContextParallel(mesh)
    model = parallelize_module(copy.deepcopy(reference), mesh, get_plan("hf_mixtral", reference, expert_parallel=True))
    model = DDP(model, mesh, zero_stage=1)
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=[model], optimizer_kwargs=adamw)
    ep = mesh["EP"].get_local_rank()
    bound = Tolerance(rtol=1e-5, atol=1e-6)
    for step, (ids, targets) in enumerate(batches):
        rows, row_targets = ids.chunk(2)[ep], targets.chunk(2)[ep]
        with cp.attention():
            loss = loss_of(model, cp.shard(rows), cp.shard(row_targets), position_ids=cp.position_ids(seq))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for name, p in model.module.named_parameters():
            assert_close(p, expected.params[step][name], name=f"step {step} {name}", tol=bound)
