"""Tiny transformers decoders for the automatic plan's tests, and the parity check they run.

``build_hf(arch)`` builds transformers' causal LM of model type ``arch`` from a tiny config (2
layers, hidden 64, 4 heads, vocab 128; eager attention and eager experts, so float64 runs on CPU).
``check_auto_parity(arch)`` parallelizes a copy with ``get_plan("auto", model)`` and nothing else
and compares logits, loss, every gradient and the parameters after optimizer steps with one
process, in float64 under the strict tolerance.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ndweave.mesh.testing import STRICT, STRICT_DTYPE, Tolerance, assert_close

BATCH, SEQ = 2, 16
# Some transformers models compute parts in float32 whatever their dtype (MoE routing:
# softmax(logits.float()); Gemma's RMSNorm): under tensor / sequence parallelism each rank's share of a
# gradient through those parts is rounded to float32 before the ranks sum them, where one process
# rounds the whole sum once: ~1e-8 to 1e-6 relative (1e-7 absolute after SGD steps), where a sharding bug
# moves values by 1e-4 or more
FLOAT32_INSIDE = Tolerance(rtol=1e-5, atol=1e-6)
#: transformers' families in ARCHS that route their experts in float32: held to FLOAT32_INSIDE
FLOAT32_ROUTING = {"mixtral", "qwen2_moe"}
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,  # (models without grouped-query attention ignore it)
            # sizes and ids configs default to their full model's (a config ignores those it has no use for)
            head_dim=16, rotary_dim=16, pad_token_id=None, bos_token_id=1, eos_token_id=2,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_group=1, topk_group=1)
# per model type: what its tiny config needs besides TINY (grouped-query attention where it has it)
ARCHS: dict[str, dict] = {
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=2),
    "phi3": dict(pad_token_id=0, num_key_value_heads=4),  # equal q, k, v pieces in the fused projection
    "gpt_neox": dict(),
    "gpt2": dict(),
    "falcon": dict(),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=4),
    "qwen2_moe": dict(num_key_value_heads=2, num_experts=4, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
}


def build_hf(arch: str, **overrides) -> nn.Module:
    """A tiny causal LM of transformers' model type ``arch`` (in the default dtype); ``"obfuscated"``:
    this file's :class:`Obfuscated`; ``"torch_encoder"``: :class:`TorchEncoderLM`; ``"autocast"``:
    :class:`AutocastLM`."""
    if arch == "obfuscated":
        return Obfuscated(**overrides)
    if arch == "torch_encoder":
        return TorchEncoderLM(**overrides)
    if arch == "autocast":
        return AutocastLM(**overrides)
    if arch == "x_transformers":  # (not a dependency: its tests skip without it)
        from x_transformers import Decoder, TransformerWrapper

        return TransformerWrapper(num_tokens=TINY["vocab_size"], max_seq_len=64, attn_layers=Decoder(
            dim=64, depth=2, heads=4, rotary_pos_emb=True, ff_glu=True))
    if arch.startswith("olmo_core_"):  # "olmo_core_llama_like", "olmo_core_olmo2_1M" (not a dependency either)
        from olmo_core.nn.transformer import TransformerConfig

        config = arch[len("olmo_core_"):]
        sizes = {"d_model": 64, "n_layers": 2, "n_heads": 4, "hidden_size_multiple_of": 16}
        sizes = sizes if config == "llama_like" else {}  # (OLMo 2's configs have their sizes)
        model = getattr(TransformerConfig, config)(vocab_size=TINY["vocab_size"], **sizes).build(init_device="cpu")
        return model.to(torch.get_default_dtype())  # (its configs name no float64)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kwargs = {**TINY, **ARCHS.get(arch, {}), **overrides}
    read_only = [k for k in kwargs if getattr(getattr(CONFIG_MAPPING[arch], k, None), "fset", True) is None]
    config = AutoConfig.for_model(arch, **{k: v for k, v in kwargs.items() if k not in read_only})  # (Falcon's head_dim)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return AutoModelForCausalLM.from_config(config)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _run(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(ids)
    logits = getattr(out, "logits", out)
    return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def check_auto_parity(arch: str, *, sequence_parallel: bool = False, steps: int = 2, tol: Tolerance = STRICT,
                      activation_checkpointing: bool = False, **overrides) -> None:
    """Run on every rank: ``get_plan("auto", model)`` on a 1-D TP mesh matches one process (logits,
    loss, gradients and parameters within ``tol``). ``activation_checkpointing``: transformers' own,
    enabled before the plan is derived (as the GPT job does) and run in training mode (for models
    without dropout), against one process without it."""
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference = build_hf(arch, **overrides).eval()  # eval: no dropout, whatever the config calls it
    model = copy.deepcopy(reference)
    if activation_checkpointing:
        model.activation_checkpointing_enable()
        model.train()  # (transformers checkpoints its layers in training mode only)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("TP",))
    model = parallelize_module(model, mesh, get_plan("auto", model, sequence_parallel=sequence_parallel))
    ref_params, params = dict(reference.named_parameters()), dict(model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9, foreach=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=False)
    for step in range(steps):
        ids, targets = _batch(step)
        ref_logits, ref_loss = _run(reference, ids, targets)
        logits, loss = _run(model, ids, targets)
        # (tol for the forwards too: a model computing in float32 inside rounds partial sums already there)
        assert_close(logits, ref_logits, name=f"{arch} step {step} logits", tol=tol)
        assert_close(loss, ref_loss, name=f"{arch} step {step} loss", tol=tol)
        ref_loss.backward()
        loss.backward()
        model.finish_grad_sync()
        _same_grads(params, ref_params, f"{arch} step {step}", tol)
        for optimizer in (ref_opt, opt):
            optimizer.step()
            optimizer.zero_grad()
    for fqn, ref_p in ref_params.items():
        assert_close(params[fqn], ref_p, name=f"{arch} {fqn} after {steps} steps", tol=tol)


def _same_grads(params: dict, ref_params: dict, where: str, tol: Tolerance) -> None:
    for fqn, ref_p in ref_params.items():
        if ref_p.grad is None:  # (a parameter the loss does not reach, e.g. an unused pooler)
            assert params[fqn].grad is None, f"{where}: {fqn} got a gradient one process does not"
        else:
            assert_close(params[fqn].grad, ref_p.grad, name=f"{where} {fqn}.grad", tol=tol)


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _Attention(nn.Module):
    """Fused q|k|v in one Linear, split with a literal size; heads reshaped with a literal count."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.n, self.h = heads, dim // heads
        self.a = nn.Linear(dim, 3 * dim, bias=False)
        self.b = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.a(x).split(self.n * self.h, dim=-1)
        q, k, v = (t.view(B, T, self.n, self.h).transpose(1, 2) for t in (q, k, v))
        q, k = (t * cos + torch.cat([-t[..., self.h // 2:], t[..., :self.h // 2]], -1) * sin for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.b(y.transpose(1, 2).reshape(B, T, self.n * self.h))


class _GatedMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.c = nn.Linear(dim, 2 * hidden, bias=False)
        self.d = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        g, u = self.c(x).chunk(2, dim=-1)
        return self.d(F.silu(g) * u)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, norm: type = _Norm, attention: type = _Attention):
        super().__init__()
        self.a, self.b, self.c, self.d = norm(dim), attention(dim, heads), norm(dim), _GatedMlp(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.b(self.a(x), cos, sin)
        return x + self.d(self.c(x))


class Obfuscated(nn.Module):
    """A Llama-shaped decoder whose modules say nothing (``blk.0.b.a`` is the fused q|k|v, ``blk.0.d``
    the SwiGLU MLP), with literal head counts: what "auto" must see through."""

    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, hidden: int = 128, layers: int = 2,
                 norm: type = _Norm, attention: type = _Attention):
        super().__init__()
        self.e = nn.Embedding(vocab, dim)
        self.blk = nn.ModuleList(_Block(dim, heads, hidden, norm, attention) for _ in range(layers))
        self.f = norm(dim)
        self.g = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("r", 1.0 / 10000 ** (torch.arange(0, dim // heads, 2) / (dim // heads)), persistent=False)

    def forward(self, ids):
        angles = torch.arange(ids.shape[1], device=ids.device)[:, None] * self.r
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.e(ids)
        for block in self.blk:
            x = block(x, cos, sin)
        return self.g(self.f(x))


class _AutocastNorm(_Norm):
    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):  # (OLMo-core's norms)
            return super().forward(x)


class _AutocastAttention(_Attention):
    def forward(self, x, cos, sin):
        with torch.autocast(x.device.type, enabled=False):  # (x-transformers' rotary embedding)
            return super().forward(x, cos, sin)


class AutocastLM(Obfuscated):
    """:class:`Obfuscated` whose norms and attention run with autocast off for their tensors' device,
    ``torch.autocast(x.device.type, enabled=False)``, as OLMo-core's norms and x-transformers' rotary
    embedding do: on meta tensors that raises "unsupported scalarType"."""

    def __init__(self, **sizes):
        super().__init__(**sizes, norm=_AutocastNorm, attention=_AutocastAttention)


class TorchEncoderLM(nn.Module):
    """torch's own modules: an embedding, ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` inside,
    causal), a head."""

    def __init__(self, vocab: int = 128, dim: int = 32, heads: int = 4, layers: int = 2, norm_first: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))
