"""Buffers: an unplanned non-persistent buffer (a RoPE table, as torchtitan's Llama keeps
``freqs_cis``) stays a plain tensor, so the model can combine it with local attention heads;
persistent and planned buffers become DTensors as before."""

import copy

import pytest
import torch
import torch.nn.functional as F
from dmodule_training import check_training_parity
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndweave.dmodule import PlacementSpec, deferred_init, parallelize_module
from ndweave.mesh.testing import distributed

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 8


def rope_table(head_dim: int, max_len: int, base: float = 10000.0) -> torch.Tensor:
    """(max_len, head_dim / 2) unit complex numbers e^(i * pos * base^(-2j / head_dim))."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2) / head_dim)
    angles = torch.arange(max_len).unsqueeze(1) * inv_freq
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """RoPE on (batch, seq, heads, head_dim): pairs of features as complex numbers, turned."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * table[: x.shape[1], None, :]).flatten(-2)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x, freqs_cis):
        B, T, _ = x.shape
        # "-1 heads": whatever this rank's projections produced (all heads on one process)
        q, k, v = (w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, freqs_cis), rotate(k, freqs_cis)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x, freqs_cis):
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """torchtitan's layout in small: the RoPE table is a non-persistent buffer read in forward."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", rope_table(DIM // HEADS, 2 * SEQ), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


_L = r"layers.\d+"
PLAN = {
    "parameter": {
        "tok_embeddings.weight": [Shard(0)],
        rf"{_L}.attention.(wq|wk|wv).weight": [Shard(0)],
        rf"{_L}.attention.wo.weight": [Shard(1)],
        rf"{_L}.feed_forward.(w1|w3).weight": [Shard(0)],
        rf"{_L}.feed_forward.w2.weight": [Shard(1)],
        "output.weight": [Shard(0)],
    },
    "forward": {
        "tok_embeddings.output": [[Replicate()]],
        # this rank's heads as plain tensors: they meet the plain RoPE table (as in the zoo)
        rf"{_L}.attention.(wq|wk|wv).output": [PlacementSpec([Shard(-1)], to_local=True)],
        rf"{_L}.attention.wo.input": [[Shard(-1)]],
        rf"{_L}.attention.wo.output": [[Replicate()]],
        rf"{_L}.feed_forward.w2.output": [[Replicate()]],
        "output.output": [[Replicate()]],
    },
    "patch": {"tok_embeddings": ["vocab_parallel_embedding"]},
}


@pytest.mark.parity
@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred_init"])
@distributed(world_size=2)
def test_llama_with_rope_buffer_matches_one_process(deferred):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    reference = Llama()
    torch.manual_seed(0)
    model = deferred_init(Llama) if deferred else copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    model = parallelize_module(model, mesh, PLAN)
    assert type(model.freqs_cis) is torch.Tensor  # the whole table, a plain tensor on every rank
    assert torch.equal(model.freqs_cis, reference.freqs_cis)
    assert "freqs_cis" not in model.state_dict()

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, SEQ + 1), generator=g) for _ in range(3)]
    check_training_parity(model, reference, batches, next_token_loss)


def next_token_loss(net, tokens):
    logits = net(tokens[:, :-1])  # a plain tensor: the Replicate output leaves the model plain
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class Buffers(nn.Module):
    def __init__(self, share_cache: bool):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("running", torch.arange(4.0))                  # persistent
        self.register_buffer("cache", torch.arange(8.0), persistent=False)   # unplanned
        self.register_buffer("table", torch.ones(4, 2), persistent=False)    # planned below
        if share_cache:  # the same tensor, held persistently by another module: it is state
            self.fc.register_buffer("shared", self.cache)

    def forward(self, x):
        return self.fc(x)


@distributed(world_size=2)
def test_which_buffers_become_dtensors():
    mesh = init_device_mesh("cpu", (2,))
    plan = {"parameter": {"table": [Shard(0)]}}
    model = parallelize_module(Buffers(share_cache=False), mesh, plan)
    assert type(model.cache) is torch.Tensor and torch.equal(model.cache, torch.arange(8.0))
    assert "(plain tensor)" in model.dump_plan()
    assert isinstance(model.running, DTensor) and model.running.placements == (Replicate(),)
    assert isinstance(model.table, DTensor) and model.table.placements == (Shard(0),)  # planned: as planned
    shared = parallelize_module(Buffers(share_cache=True), mesh, plan)
    assert isinstance(shared.cache, DTensor) and shared.fc.shared is shared.cache
