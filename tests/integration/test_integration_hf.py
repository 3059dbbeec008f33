"""Real HF models, unchanged, on DP=2 x TP=2: zoo plan + DDP + DistributedOptimizer vs one process.

GPT-2 brings tied embeddings and a vocabulary (50257) no TP size divides; Llama brings grouped-query
attention and RMSNorm weights whose sequence-parallel grads come out Partial.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed, full_tensor
from ndweave.optim import DistributedOptimizer

STEPS, BATCH, SEQ = 4, 4, 8


def _build(name, vocab=128):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "hf_gpt2":
        cfg = transformers.GPT2Config(vocab_size=50257, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                                   attention_dropout=0.0, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _train(model, optimizer, data, dp_rank=None, dp_group=None):
    losses = []
    for ids in data:
        if dp_rank is not None:
            ids = ids.chunk(2)[dp_rank]
        optimizer.zero_grad()
        logits = model(input_ids=ids).logits  # the loss outside the model, next-token targets
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        value = full_tensor(loss).reshape(1)
        if dp_group is not None:
            dist.all_reduce(value, group=dp_group)
            value /= 2
        losses.append(value.item())
    return losses


# vocab 129: an uneven lm_head shard that DDP lays out first (reverse registration order), ahead of
# the sequence-parallel norm weights whose Partial grads must still be reduced on the right elements
@pytest.mark.parity
@pytest.mark.parametrize("name,sp,vocab", [("hf_gpt2", False, None), ("hf_gpt2", True, None),
                                          ("hf_llama", True, 128), ("hf_llama", True, 129)])
@distributed(world_size=4, timeout=300)
def test_hf_model_dp_tp_zero_matches_one_process(name, sp, vocab):
    DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    reference = _build(name, vocab)
    model = copy.deepcopy(reference)
    model = parallelize_module(model, DEVICE_MESH["TP"], get_plan(name, model, sequence_parallel=sp))
    model = DDP(model, DEVICE_MESH["DP"], use_distributed_optimizer=True, bucket_size=20_000)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    optimizer = DistributedOptimizer(torch.optim.SGD, models=[model], clip_grad=1.0, optimizer_kwargs=kwargs)

    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, reference.config.vocab_size, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    losses = _train(model, optimizer, data, DEVICE_MESH.get_data_parallel_rank(), DEVICE_MESH.get_data_parallel_group())

    class Clipped(torch.optim.SGD):
        def step(self, closure=None):
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            return super().step(closure)

    ref_losses = _train(reference, Clipped(reference.parameters(), **kwargs), data)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), name="losses")
    ref_params = dict(reference.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(ref_params)
    if name == "hf_gpt2":  # tied embeddings survived TP, DDP and the sharded optimizer
        inner = model.module
        assert inner.lm_head.weight is inner.transformer.wte.weight
    for n, p in model.named_parameters():
        assert_close(p, ref_params[n], name=n)
