"""Context parallel (``ndweave.dmodule.context``): the sequence split over a CP dim with causal load
balance, attention across it, against one process on the whole sequence. Each rank computes the loss
of its own tokens (their mean, outside the model, against plain targets); every rank holds as many
tokens, so the mean of the ranks' losses is one process's loss and the mean of their gradients one
process's gradients (what DDP over DP x CP reduces). Logits, loss and every gradient: float64 strict
for the GPT and torch's own layers; transformers' models, which normalize in float32, to FLOAT32_INSIDE."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ndweave.dmodule.context import ContextParallel, ContextParallelError, SequenceLayout
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import STRICT, STRICT_DTYPE, Tolerance, assert_close, distributed

_T, _B, _VOCAB = 32, 2, 128


def test_each_rank_holds_a_head_and_a_tail_chunk():
    layout = SequenceLayout(8, 2)
    assert layout.positions(0).tolist() == [0, 1, 6, 7] and layout.positions(1).tolist() == [2, 3, 4, 5]
    assert SequenceLayout(8, 2, load_balance=False).positions(1).tolist() == [4, 5, 6, 7]
    whole = torch.arange(3 * 16).view(3, 16)
    four = SequenceLayout(16, 4)
    shards = [four.shard(whole, r) for r in range(4)]
    assert torch.equal(four.unshard(torch.cat(shards, dim=1)), whole)
    # causal work even: the sum of positions (the keys each query sees) is the same on every rank
    assert len({int(four.positions(r).sum()) for r in range(4)}) == 1


def test_a_sequence_that_does_not_split_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"sequence of 30 tokens does not divide into 8.*multiple of 8"):
        SequenceLayout(30, 4)


def _cp(**kwargs) -> ContextParallel:
    """Float64, seed 0, and context parallel over every rank."""
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    return ContextParallel(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("CP",)), **kwargs)


def _gpt(**overrides):
    from gpt_model import GPT, GPTConfig

    return GPT(GPTConfig(**{**{"vocab_size": _VOCAB, "block_size": _T, "n_layer": 2, "n_head": 4, "n_embd": 32, "dropout": 0.0},
                            **overrides}))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, _VOCAB, (_B, _T), generator=torch.Generator().manual_seed(100 + step))
    return ids, torch.roll(ids, -1, dims=1)


def _logits(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out[0]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _check_cp_parity(reference, model, cp: ContextParallel, *, steps: int, tol: Tolerance,
                     ref_kwargs=None, positions=None, attention=None) -> None:
    """``steps`` AdamW steps: the reference on whole sequences (``ref_kwargs(step)`` besides the ids),
    ``model`` on this rank's tokens at ``positions(step)`` (default: their global positions) within
    ``cp.attention(**attention(step))``."""
    ref_kwargs = ref_kwargs or (lambda step: {})
    positions = positions or (lambda step: cp.position_ids(_T))
    attention = attention or (lambda step: {})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(steps):
        ids, targets = _batch(step)
        ref_logits = _logits(reference(ids, **ref_kwargs(step)))
        ref_loss = _loss(ref_logits, targets)
        ref_loss.backward()
        with cp.attention(**attention(step)):
            logits = _logits(model(cp.shard(ids), position_ids=positions(step)))
        loss = _loss(logits, cp.shard(targets))
        loss.backward()
        assert_close(logits, cp.shard(ref_logits), name=f"step {step} logits of this rank's tokens", tol=tol)
        if step == 0:  # (every rank's tokens back in order)
            assert_close(cp.unshard(logits.detach()), ref_logits, name="the whole sequence's logits", tol=tol)
        group = cp.mesh.get_group()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        assert_close(mean / cp.size, ref_loss, name=f"step {step} loss (mean over CP ranks)", tol=tol)
        for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # (TP's shard: its CP peers hold the same)
            dist.all_reduce(grad, group=group)  # (what DDP over the CP ranks does: their mean)
            grad /= cp.size
            assert_close(p.grad, ref_p.grad, name=f"step {step} {name}.grad", tol=tol)
        for optimizer in (ref_opt, opt):
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, ref_p, name=f"{name} after {steps} steps", tol=tol)


def _gpt_causal() -> None:
    cp = _cp()
    reference = _gpt()
    _check_cp_parity(reference, copy.deepcopy(reference), cp, steps=2, tol=STRICT)


@pytest.mark.parity
@distributed(world_size=2)
def test_the_gpt_at_cp2_trains_like_one_process():
    _gpt_causal()


@pytest.mark.parity
@distributed(world_size=4)
def test_the_gpt_at_cp4_trains_like_one_process():
    _gpt_causal()


def _documents(step: int) -> torch.Tensor:
    """(B, T) document ids of a packed batch: documents of 5 to 12 tokens, cut anywhere."""
    g = torch.Generator().manual_seed(7 + step)
    rows = []
    for _ in range(_B):
        lengths = []
        while sum(lengths) < _T:
            lengths.append(int(torch.randint(5, 13, (1,), generator=g)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:_T])
    return torch.stack(rows)


def _restarting_positions(documents: torch.Tensor) -> torch.Tensor:
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    index = torch.arange(documents.shape[1]).expand_as(documents)
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


@pytest.mark.parity
@distributed(world_size=2)
def test_packed_documents_see_only_their_own_tokens_across_cp():
    """The GPT on packed batches: one process takes the block-diagonal causal mask and positions that
    restart per document; CP ranks take the whole batch's document ids (``documents=``) and their
    shard of those positions."""
    cp = _cp()
    reference = _gpt()

    def ref_kwargs(step):
        docs = _documents(step)
        causal = torch.ones(_T, _T, dtype=torch.bool).tril()
        mask = (docs[:, :, None] == docs[:, None, :]) & causal
        return dict(attention_mask=mask[:, None], position_ids=_restarting_positions(docs))

    _check_cp_parity(reference, copy.deepcopy(reference), cp, steps=2, tol=STRICT, ref_kwargs=ref_kwargs,
                     positions=lambda step: cp.shard(_restarting_positions(_documents(step))),
                     attention=lambda step: dict(documents=_documents(step)))


def _hf(arch: str, **overrides):
    from dmodule_auto_models import build_hf

    model = build_hf(arch, **overrides)
    model.config._attn_implementation = "sdpa"  # (transformers' SDPA attention: F.scaled_dot_product_attention)
    return model.eval()


#: (model, its attention) at CP=2: transformers' "sdpa" attention; their "eager" attention, written by
#: hand (matmul, softmax, matmul, the causal mask added to the scores; Gemma 2's soft-capped scores,
#: tanh between the matmul and the mask); a module as a user writes it ("user": ``masked_fill`` of a
#: ``tril``). No SDPA in the last three: the shapes say which ops are attention's.
DECODERS = [("llama", "sdpa"), ("qwen2", "sdpa"), ("gpt_neox", "sdpa"), ("phi3", "sdpa"), ("llama", "eager"),
            ("gemma2", "eager"), ("user", "eager")]


@pytest.mark.parity
@pytest.mark.parametrize("arch, attention", DECODERS)
def test_decoders_at_cp2_train_like_one_process(arch, attention):
    _decoder_at_cp2(arch, attention)


@pytest.mark.parity
@pytest.mark.parametrize("arch, attention", [("llama", "sdpa"), ("gemma2", "eager")])
def test_decoders_at_cp4_train_like_one_process(arch, attention):
    _decoder_at_cp4(arch, attention)


@distributed(world_size=2)
def _decoder_at_cp2(arch: str, attention: str) -> None:
    _decoder_body(arch, attention)


@distributed(world_size=4)
def _decoder_at_cp4(arch: str, attention: str) -> None:
    _decoder_body(arch, attention)


def _decoder_body(arch: str, attention: str) -> None:
    """Transformers' models to the float32 bound of their float32 norms (and eager softmax); the user's
    module strict. Attention written by hand applies its own causal mask, which CP replaces only when
    told so (Gemma 2's window, 4096 by default, covers the sequence)."""
    from dmodule_auto_models import FLOAT32_INSIDE, build_hf

    cp = _cp()
    if arch == "user":
        reference, tol = _UserLM(), STRICT
    else:
        reference, tol = build_hf(arch).eval(), FLOAT32_INSIDE
        reference.config._attn_implementation = attention
    model = copy.deepcopy(reference)
    replace = None
    if attention == "eager":
        with pytest.raises(ContextParallelError, match=r"scores with a mask of shape .* replace_model_mask=True"):
            with cp.attention():
                model(cp.shard(_batch(0)[0]), position_ids=cp.position_ids(_T))
        replace = lambda step: dict(replace_model_mask=True)  # noqa: E731
    _check_cp_parity(reference, model, cp, steps=2, tol=tol, attention=replace)


@pytest.mark.parity
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_sliding_window_is_rebuilt_from_global_positions(implementation):
    _sliding_window(implementation)


@distributed(world_size=2)
def _sliding_window(implementation: str) -> None:
    """Mistral with a window of 8 tokens over 32: transformers builds a windowed mask for the local
    tokens, which CP refuses until ``window=`` and ``replace_model_mask=True`` say what it means."""
    from dmodule_auto_models import FLOAT32_INSIDE

    cp = _cp()
    reference = _hf("mistral", sliding_window=8)
    reference.config._attn_implementation = implementation
    model = copy.deepcopy(reference)
    with pytest.raises(ContextParallelError, match="mask of shape .* replace_model_mask=True"), cp.attention():
        model(cp.shard(_batch(0)[0]), position_ids=cp.position_ids(_T))
    _check_cp_parity(reference, model, cp, steps=2, tol=FLOAT32_INSIDE,
                     attention=lambda step: dict(window=8, replace_model_mask=True))


@pytest.mark.parity
@pytest.mark.parametrize("load_balance", [True, False])
def test_bidirectional_attention_an_encoder_at_cp2(load_balance):
    _encoder_parity(load_balance)


@distributed(world_size=2)
def _encoder_parity(load_balance: bool) -> None:
    """transformers' BERT (masked LM; SDPA attention, no mask: every token sees every token)."""
    from dmodule_auto_models import FLOAT32_INSIDE
    from transformers import BertConfig, BertForMaskedLM

    cp = _cp(load_balance=load_balance)
    config = BertConfig(vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=_T, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    reference = BertForMaskedLM(config).eval()
    _check_cp_parity(reference, copy.deepcopy(reference), cp, steps=1, tol=FLOAT32_INSIDE)


@pytest.mark.parity
@pytest.mark.parametrize("model", ["gpt", "llama_eager"])
def test_cp2_by_tp2_trains_like_one_process(model):
    _cp_by_tp(model)


@distributed(world_size=4)
def _cp_by_tp(model_name: str) -> None:
    """The GPT under the zoo's TP plan, or transformers' Llama attending "eager" under the auto plan,
    on ``mesh["TP"]`` and CP over ``mesh["CP"]``: attention runs on each TP rank's heads, across the CP
    ranks' tokens."""
    from dmodule_auto_models import FLOAT32_INSIDE, build_hf

    from ndweave.dmodule import get_plan, parallelize_module

    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("CP", "TP"))
    if model_name == "gpt":
        reference, plan, tol, attention = _gpt(), "nanogpt", STRICT, None
    else:
        reference, plan, tol = build_hf("llama").eval(), "auto", FLOAT32_INSIDE
        attention = lambda step: dict(replace_model_mask=True)  # noqa: E731
    model = parallelize_module(copy.deepcopy(reference), mesh["TP"], get_plan(plan, reference))
    _check_cp_parity(reference, model, ContextParallel(mesh), steps=2, tol=tol, attention=attention)


@pytest.mark.parity
@distributed(world_size=2)
def test_checkpointed_layers_recompute_across_cp_in_backward():
    """Activation checkpointing: each GPT block recomputed in backward, which runs inside
    ``cp.attention()`` (a mode is off while it handles the backward call, so F's SDPA is routed across CP
    meanwhile); the logits and every grad equal one process's (float64, strict)."""
    cp = _cp()
    reference = _gpt()
    model = copy.deepcopy(reference)
    model.activation_checkpointing_enable()
    ids, targets = _batch(0)
    ref_logits = _logits(reference(ids))
    _loss(ref_logits, targets).backward()
    with cp.attention():
        logits = _logits(model(cp.shard(ids), position_ids=cp.position_ids(_T)))
        _loss(logits, cp.shard(targets)).backward()
    assert_close(logits, cp.shard(ref_logits), name="logits", tol=STRICT)
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        dist.all_reduce(p.grad)
        assert_close(p.grad / 2, ref_p.grad, name=f"{name}.grad", tol=STRICT)


@distributed(world_size=2)
def test_what_cp_cannot_split_is_refused_on_every_rank():
    cp = ContextParallel(init_device_mesh("cpu", (2,), mesh_dim_names=("CP",)))
    with pytest.raises(ValueError, match="sequence of 30 tokens does not divide into 4"):
        cp.shard(torch.zeros(2, 30))
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ContextParallelError, match="4 queries and 6 keys .* cross-attention"), cp.attention():
        F.scaled_dot_product_attention(q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
    with pytest.raises(ContextParallelError, match=r"attn_mask of shape \(4, 4\)"), cp.attention():
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ContextParallelError, match="'CP' dim"):
        ContextParallel(init_device_mesh("cpu", (1, 2), mesh_dim_names=("DP", "TP")))


class _UserLM(torch.nn.Module):
    """One causal self-attention layer written by hand (the shape users copy from tutorials)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed, self.pos = torch.nn.Embedding(_VOCAB, dim), torch.nn.Embedding(_T, dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, _VOCAB)
        self.register_buffer("tril", torch.ones(_T, _T, dtype=torch.bool).tril(), persistent=False)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t = ids.shape
        positions = torch.arange(t)[None] if position_ids is None else position_ids
        x = self.embed(ids) + self.pos(positions)
        q, k, v = (part.view(b, t, self.heads, -1).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5
        scores = scores.masked_fill(~self.tril[:t, :t], float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.out(x + y)


@distributed(world_size=1)
def test_one_cp_rank_runs_attention_written_by_hand_as_it_is():
    """A CP dim of one rank: its tokens are the whole sequence, so attention written by hand runs as
    written (no matmul or mask is taken for attention's), and no attention call is asked for."""
    cp = _cp()
    model = _UserLM()
    ids = _batch(0)[0]
    with cp.attention(window=4):  # (a window would refuse any matmul taken for attention's)
        out = model(cp.shard(ids), position_ids=cp.position_ids(_T))
    assert torch.equal(out, model(ids))


@distributed(world_size=2)
def test_attention_cp_cannot_read_is_refused_not_run_locally():
    """Attention in a form CP does not recognise (einsum) would leave each rank attending to its own
    tokens only: leaving cp.attention() raises, naming the fix. A bias added to the scores (relative
    positions, ALiBi) was built for local tokens: refused."""
    cp = _cp()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ContextParallelError, match="no attention ran.*attn_implementation"), cp.attention():
        torch.einsum("bhqk,bhkd->bhqd", torch.einsum("bhqd,bhkd->bhqk", q, q).softmax(-1), q)
    bias = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    bias -= torch.arange(4.0)[None, :]  # (ALiBi's slope: a distance penalty)
    with pytest.raises(ContextParallelError, match="adds a bias to its attention scores"):
        with cp.attention(replace_model_mask=True):
            (q @ q.transpose(-2, -1) + bias).softmax(-1) @ q


def _activation_peak(seq: int, layers: int) -> int:
    """Peak bytes of live tensors a forward and backward of this rank's tokens add (the model built
    first), fp32: CP over every rank, or plain attention on one."""
    import contextlib

    from ndweave.mesh.testing.memory import TensorMemory

    torch.manual_seed(0)
    world = dist.get_world_size()
    cp = ContextParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("CP",)))
    ids = torch.randint(0, _VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    with TensorMemory() as memory:
        model = _gpt(block_size=seq, n_layer=layers, n_embd=64).float()
        ids, targets, positions = cp.shard(ids), cp.shard(torch.roll(ids, -1, 1)), cp.position_ids(seq)
        memory.reset_peak()
        before = memory.peak_bytes("cpu")
        with cp.attention() if world > 1 else contextlib.nullcontext():
            logits, _ = model(ids, position_ids=positions)
        _loss(logits, targets).backward()
        return memory.peak_bytes("cpu") - before


@pytest.mark.heavy
def test_activation_memory_divides_by_cp():
    """A 4096-token sequence through 8 layers: a rank's peak of activations at CP=2 and CP=4 against
    one process's (which attends with CPU's flash kernel): the issue's targets 0.55x and 0.3x. Causal
    attention across CP keeps no T x T weights and no mask, and does not save the gathered keys."""
    one = _activation_peak_on(1)
    two, four = _activation_peak_on(2), _activation_peak_on(4)
    assert two / one <= 0.55 and four / one <= 0.3, (one, two, four, two / one, four / one)


def _activation_peak_on(world: int) -> int:
    from ndweave.mesh.testing import run_distributed

    return max(run_distributed(_activation_peak, world, 4096, 8, timeout=300))


@distributed(world_size=4)
def test_keys_and_values_cross_cp_as_the_theory_says():
    """Per layer and rank, forward: the keys and values of the other CP - 1 ranks come in once (an
    all-gather of each, (CP - 1) / CP of the sequence's); backward: once more, and their grads go back
    out by a reduce-scatter of the same size."""
    from ndweave.dmodule.context import exchange

    cp = _cp()
    model = _gpt(n_layer=3)
    moved = {"gathered": 0, "scattered": 0}
    gather, scatter = exchange.all_gather_flat, exchange.reduce_scatter_flat

    def counted_gather(out, local, group):
        moved["gathered"] += (out.numel() - local.numel()) * out.element_size()  # what came from the others
        return gather(out, local, group=group)

    def counted_scatter(out, whole, group):
        moved["scattered"] += (whole.numel() - out.numel()) * whole.element_size()  # what went to the others
        return scatter(out, whole, group=group)

    exchange.all_gather_flat, exchange.reduce_scatter_flat = counted_gather, counted_scatter
    try:
        ids, targets = _batch(0)
        with cp.attention():
            logits, _ = model(cp.shard(ids), position_ids=cp.position_ids(_T))
        forward = moved["gathered"]
        _loss(logits, cp.shard(targets)).backward()
    finally:
        exchange.all_gather_flat, exchange.reduce_scatter_flat = gather, scatter
    kv = 2 * _B * _T * 32 * 8  # K and V of the whole sequence, one layer: (B, T, n_embd) float64 each
    assert forward == 3 * kv * 3 // 4, (forward, kv)  # (3 layers, (CP - 1) / CP of each)
    assert moved["gathered"] == 2 * forward and moved["scattered"] == forward, moved


@pytest.mark.parity
@pytest.mark.parametrize("model_name", ["gpt", "llama_eager"])
def test_compiled_blocks_under_cp_break_only_at_attention(model_name):
    _compiled_blocks(model_name)


@distributed(world_size=2)
def _compiled_blocks(model_name: str) -> None:
    """Each block compiled (inductor): attention across CP runs between the block's graphs, the only
    graph breaks, giving their reason (SDPA: one per block; attention written by hand: at its scores,
    its mask and its weighted values); nothing compiles again after the first step; the logits and
    every grad equal one process's (the GPT: float64, strict; transformers' Llama: its float32 bound)."""
    from dmodule_auto_models import FLOAT32_INSIDE, build_hf

    from ndweave.dmodule.context import ATTENTION_BREAK
    from ndweave.mesh.torch_compat import compile_counts, reset_compile_counts

    cp = _cp()
    if model_name == "gpt":
        reference, tol, attention = _gpt(n_layer=3), STRICT, {}
        blocks = lambda model: model.transformer.h  # noqa: E731
    else:
        reference, tol, attention = build_hf("llama", use_cache=False).eval(), FLOAT32_INSIDE, {"replace_model_mask": True}
        blocks = lambda model: model.model.layers  # noqa: E731
    model = copy.deepcopy(reference)
    torch.compiler.reset()  # (a pooled rank may have compiled this code for an earlier test)
    for block in blocks(model):
        block.compile()
    for step in range(3):
        ids, targets = _batch(step)
        ref_logits = _logits(reference(ids))
        _loss(ref_logits, targets).backward()
        reset_compile_counts()
        with cp.attention(**attention):
            logits = _logits(model(cp.shard(ids), position_ids=cp.position_ids(_T)))
        _loss(logits, cp.shard(targets)).backward()
        counts = compile_counts()
        assert_close(logits, cp.shard(ref_logits), name=f"step {step} logits", tol=tol)
        for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
            dist.all_reduce(p.grad)
            assert_close(p.grad / 2, ref_p.grad, name=f"step {step} {name}.grad", tol=tol)
        for m in (model, reference):
            m.zero_grad()
        assert set(counts.break_reasons()) == ({ATTENTION_BREAK} if step == 0 else set()), counts.break_reasons()
        # (by hand, the first step's resumed frames between the breaks compile for more than one shape)
        first_recompiles = step == 0 and model_name != "gpt"
        assert (counts.graphs > 0) == (step == 0) and (first_recompiles or not counts.recompiles), f"step {step}: {counts}"
