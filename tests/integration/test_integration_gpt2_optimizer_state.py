"""HF GPT-2's optimizer state under DP=2 x TP=2 (the zoo plan's ``StridedShard`` fused q|k|v, an
uneven vocab, tied embeddings) gathers into exactly a single-process AdamW's state, and reloads at
DP=4, at DP=1 x TP=4 and into a plain one-device ``torch.optim.AdamW``, each continuing as if never
interrupted. Both sides in float64, strict tolerance.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import assert_close, distributed
from ndweave.optim import MASTER_KEY, DistributedOptimizer, to_torch_state_dict

BATCH, SEQ, VOCAB = 4, 8, 129  # 129: an uneven vocab shard at TP=2 and TP=4
STEPS, MORE_STEPS = 3, 2
# eps: the key third of c_attn.bias has a true gradient of exactly zero (softmax ignores a per-query
# constant); its float64 rounding noise (~1e-18) over Adam's default eps would still move it ~1e-12
ADAMW = {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}


def _gpt2(seed: int) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def _batches(first: int, count: int) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
            for step in range(first, first + count)]


def _train(model, optimizer, batches, dp_rank: int = 0, dp_size: int = 1) -> None:
    for ids in batches:
        ids = ids.chunk(dp_size)[dp_rank]
        optimizer.zero_grad()
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()


def _parallel(seed: int, dp: int, tp: int):
    """GPT-2 on a DP x TP mesh of every rank: the zoo plan (TP > 1), DDP, DistributedOptimizer."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("DP", "TP"))
    model = _gpt2(seed)
    if tp > 1:
        model = parallelize_module(model, mesh["TP"], get_plan("hf_gpt2", model))
    model = DDP(model, mesh["DP"], use_distributed_optimizer=True, bucket_size=5_000)
    optimizer = DistributedOptimizer(torch.optim.AdamW, [model], optimizer_kwargs=ADAMW)
    return model, optimizer, mesh.get_data_parallel_rank()


def _assert_state_matches(full: dict, reference: torch.nn.Module, ref_opt: torch.optim.Optimizer, steps: int) -> None:
    names = [n for n, _ in reference.named_parameters()]
    assert sorted(full["state"]) == sorted(names)
    for name, p in reference.named_parameters():
        entry, expected = full["state"][name], ref_opt.state[p]
        assert_close(entry[MASTER_KEY], p, name=f"{name} master")
        assert_close(entry["exp_avg"], expected["exp_avg"], name=f"{name} exp_avg")
        assert_close(entry["exp_avg_sq"], expected["exp_avg_sq"], name=f"{name} exp_avg_sq")
        assert float(entry["step"]) == float(expected["step"]) == steps


def _assert_params_match(model: torch.nn.Module, reference: torch.nn.Module, layout: str) -> None:
    params = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert_close(params[name], p, name=f"{layout}: {name}")


@pytest.mark.parity
@distributed(world_size=4, timeout=600)
def test_gpt2_state_gathers_at_dp2_tp2_and_resumes_at_dp4_tp4_and_one_device():
    torch.set_default_dtype(torch.float64)
    reference = _gpt2(seed=0)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    first, more = _batches(0, STEPS), _batches(STEPS, MORE_STEPS)

    # DP=2 x TP=2: c_attn is StridedShard(1 / 0, split_factor=3), wte (tied lm_head) 65/64 rows
    model, optimizer, dp_rank = _parallel(seed=0, dp=2, tp=2)
    _train(model, optimizer, first, dp_rank, 2)
    full = optimizer.gather_full_state_dict()
    sharded: list = [None] * dist.get_world_size()
    dist.all_gather_object(sharded, optimizer.state_dict())
    _train(reference, ref_opt, first)
    _assert_state_matches(full, reference, ref_opt, STEPS)
    _train(reference, ref_opt, more)  # the reference run every resumed one must match

    # DP=4 (plain params) from the full state; DP=1 x TP=4 from every rank's sharded pieces
    for dp, tp, state in ((4, 1, full), (1, 4, sharded)):
        model, optimizer, dp_rank = _parallel(seed=1, dp=dp, tp=tp)  # other weights: the masters must replace them
        optimizer.load_state_dict(state)
        _train(model, optimizer, more, dp_rank, dp)
        _assert_params_match(model.module, reference, f"DP={dp} x TP={tp}")
    _assert_state_matches(optimizer.gather_full_state_dict(), reference, ref_opt, STEPS + MORE_STEPS)

    # one device, plain torch AdamW: masters into the model, the rest through torch's format
    plain = _gpt2(seed=1)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(full["state"][name][MASTER_KEY])
    adamw = torch.optim.AdamW(plain.parameters(), **ADAMW)
    adamw.load_state_dict(to_torch_state_dict(full, [[n for n, _ in plain.named_parameters()]]))
    _train(plain, adamw, more)
    _assert_params_match(plain, reference, "one device")
