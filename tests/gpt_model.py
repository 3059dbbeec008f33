"""A small nanoGPT-style GPT: the model the ``"nanogpt"`` plan of ``ndweave.dmodule.plans`` shards.

Single-device PyTorch, nothing distributed in it. Two choices make it shard cleanly under tensor
parallelism without patches to its own code:

- attention has separate ``q_proj`` / ``k_proj`` / ``v_proj`` projections (nanoGPT fuses them in one
  ``c_attn``; a fused weight split column-wise over ranks would mix q, k and v heads), and
- head counts are never read in ``forward``: ``view(B, T, -1, head_dim)`` takes however many heads
  the local projection produced, so a rank holding ``n_head / tp`` heads just works.

``lm_head`` is tied to ``wte`` by default (as in nanoGPT; ``GPTConfig(tie_weights=False)`` unties it).
``GPTConfig(moe_experts=E, moe_top_k=k)`` makes every MLP a mixture of ``E`` experts (:class:`MoE`),
their weights stacked in 3-D as transformers' MoE models stack them, which is what
``ndweave.dmodule``'s ``"expert_parallel"`` patch divides over an ``"EP"`` mesh dim.
It knows nothing of pipelines: ``ndweave.pipeline`` traces its ``forward`` and runs each stage's part.
``activation_checkpointing_enable()`` (transformers' name for it) recomputes each block's activations
in backward instead of keeping them (``torch.utils.checkpoint``, inside the block, so a trace of
``GPT.forward`` still sees each block as one call).

    from ndweave_gpt.models.nanogpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))
    logits, loss = model(idx, targets)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Experts", "GPTConfig", "GPT", "GPTOutput", "MoE"]


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    """Biases in Linears and LayerNorms (GPT-2 has them)."""
    tie_weights: bool = True
    """Share one weight between ``transformer.wte`` and ``lm_head``."""
    moe_experts: int = 0
    """Experts per MoE block; 0: a dense MLP in every block."""
    moe_top_k: int = 2
    """Experts each token is routed to (with ``moe_experts``)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask``: ``(B, 1, T, T)`` bool, True where a query may attend (packed documents'
        block-diagonal causal mask); ``None``: causal over the whole sequence."""
        B, T, _ = x.shape
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim); "-1 heads" is what makes local heads work
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=attention_mask is None,
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Experts(nn.Module):
    """``num_experts`` MLPs (``c_fc``, GELU, ``c_proj``, no biases) stacked in 3-D weights, called as
    transformers' experts are: ``(x (N, C), top_k_index (N, k), top_k_weights (N, k)) -> (N, C)``.

    Every expert runs on every row and the row sums them weighted by its gates (0 for the experts it
    was not routed to): no data-dependent shapes, so the pipeline can trace it on ``meta`` tensors,
    at ``num_experts / k`` times a sparse kernel's FLOPs (a small model's choice). Under expert
    parallelism each rank runs its ``num_experts / EP`` experts on the rows routed to them."""

    def __init__(self, num_experts: int, n_embd: int, inner: int):
        super().__init__()
        self.num_experts = num_experts  # under expert parallelism: this rank's experts while they run
        self.c_fc = nn.Parameter(torch.empty(num_experts, inner, n_embd))
        self.c_proj = nn.Parameter(torch.empty(num_experts, n_embd, inner))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        gates = x.new_zeros(x.shape[0], self.num_experts).scatter(1, top_k_index, top_k_weights)
        h = F.gelu(torch.einsum("nc,eic->nei", x, self.c_fc))
        return torch.einsum("ne,nei,eci->nc", gates, h, self.c_proj)


class MoE(nn.Module):
    """A mixture of experts in place of the MLP: a softmax router picks each token's top-k experts
    and their weights (renormalized to sum to 1); the token's output is their weighted sum."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.top_k = config.moe_top_k
        self.router = nn.Linear(config.n_embd, config.moe_experts, bias=False)
        self.experts = Experts(config.moe_experts, config.n_embd, 4 * config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.softmax(self.router(flat), -1).topk(self.top_k, -1)
        return self.experts(flat, index, weights / weights.sum(-1, keepdim=True)).view_as(x)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if config.moe_experts else MLP(config)
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:  # keep only x; recompute the rest in backward
            return checkpoint(self._forward, x, attention_mask, use_reentrant=False)
        return self._forward(x, attention_mask)

    def _forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPTOutput(NamedTuple):
    """What :class:`GPT` returns: ``logits, loss = model(x, y)`` (nanoGPT's pair)."""

    logits: torch.Tensor
    loss: torch.Tensor | None

    def __getattr__(self, name: str):
        # the seeds' loop writes `loss = model(x, y); loss.backward()`: say what to unpack, not
        # "'tuple' object has no attribute 'backward'"
        raise AttributeError(f"GPT returns (logits, loss), not the loss alone: unpack it, `logits, loss = "
                             f"model(x, y)`, then use `loss.{name}`")


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "experts.c_proj")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def activation_checkpointing_enable(self) -> None:
        """Recompute every block's activations in backward (per layer and non-reentrant, as
        transformers' models do under the same call)."""
        for block in self.transformer.h:
            block.gradient_checkpointing = True

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, Experts):
            nn.init.normal_(module.c_fc, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> GPTOutput:
        """``input_ids``: (B, T) token ids. Returns ``(logits, loss)`` (:class:`GPTOutput`); ``loss`` is
        None without targets. Packed documents (``ndweave.data``'s ``documents`` packing) pass their
        ``position_ids`` (B, T), restarting at each document, and ``attention_mask``, the ``(B, 1, T, T)``
        bool block-diagonal causal mask (``ndweave.data.document_mask``), as a transformers model takes them."""
        T = input_ids.shape[1]
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        if position_ids is None:
            position_ids = torch.arange(T, dtype=torch.long, device=input_ids.device).unsqueeze(0)  # (1, T)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(position_ids))
        for block in self.transformer.h:
            x = block(x, attention_mask)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return GPTOutput(logits, loss)
