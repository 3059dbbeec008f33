"""Context parallel composed with data parallel: the GPT at DP=2 x CP=2, ndweave's DDP over the
DP x CP ranks (flattened: CP ranks split the tokens as DP ranks split the rows, so their grads are
averaged alike) and the DistributedOptimizer (ZeRO-1 and ZeRO-2) stepping AdamW, against one process
in float64, every parameter after every step."""

from __future__ import annotations

import pytest

from ndweave.mesh.testing import run_distributed


@pytest.mark.parity
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_dp2_by_cp2_with_zero_trains_like_one_process(zero_stage):
    run_distributed(_dp_cp_zero, 4, zero_stage, timeout=300)


def _dp_cp_zero(zero_stage: int) -> None:
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
    model = DDP(copy.deepcopy(reference), mesh.flatten(("DP", "CP"), "DP_CP"), dim="DP_CP", zero_stage=zero_stage,
                bucket_size=4_000)  # (several buckets)
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
