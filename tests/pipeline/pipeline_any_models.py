"""Models written for one device that keep no layer container and compute between their layers in
the root ``forward``, for the traced pipeline tests (``construct_pipeline_stage(..., example_inputs=)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline_models import SEQ, VOCAB, WIDTH, Block


class AttrLM(nn.Module):
    """Blocks as plain attributes (veScale's ``mlp1 ... mlp8`` style); the root adds positions, skips
    over two blocks, norms and scales by a weight of its own, and reshapes with the batch's sizes."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.block1, self.block2, self.block3, self.block4 = Block(), Block(), Block(), Block()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        assert T <= SEQ, f"{T} tokens > {SEQ}"
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        h = self.block2(self.block1(x)) + x
        h = F.layer_norm(h, (WIDTH,)) * self.scale
        h = self.block4(self.block3(h))
        return self.head(self.norm(h)).reshape(B * T, -1).view(B, T, -1)


class Rotary(nn.Module):
    """No parameters: ``(cos, sin)`` of each position, a tuple every layer reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.linspace(0.1, 1.0, WIDTH), persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = pos[..., None].to(self.freqs.dtype) * self.freqs
        return angles.cos(), angles.sin()


class MixBlock(nn.Module):
    """Takes the hidden states, the rotary tuple, int position ids (it embeds them) and a bool mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)

    def forward(self, x: torch.Tensor, rope: tuple, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cos, sin = rope
        h = self.fc(x) * cos + x * sin + self.pos(pos)
        h = (h.unsqueeze(1) * mask.unsqueeze(-1)).sum(2) / mask.sum(-1, keepdim=True)  # causal mean
        return x + torch.tanh(h)


class TupleLM(nn.Module):
    """Layers in a list, each called with four values the root computed once: several tensors (a
    tuple among them, ints and bools) cross every cut."""

    def __init__(self, num_layers: int = 6) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.rotary = Rotary()
        self.layers = nn.ModuleList([MixBlock() for _ in range(num_layers)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device).expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
        rope = self.rotary(pos)
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x, rope, pos=pos, mask=mask)
        return {"logits": self.head(x)}
