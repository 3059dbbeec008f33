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


class TorchEncoderLM(nn.Module):
    """A small causal LM on torch's own ``nn.TransformerEncoder`` (whose forward reads attributes of
    its layers, so a placeholder cannot stand in for one)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        # no biases: the key's gets no gradient in exact arithmetic (softmax ignores a shift), only noise
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.encoder(self.emb(ids), mask=mask, is_causal=True))


class ReusedLM(nn.Module):
    """One block called first and last (ALBERT's layer sharing: its weights used on two stages), and a
    weight of the root's that the forward adds after every block (read on every stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.shared = Block()
        self.block1, self.block2, self.block3 = Block(), Block(), Block()
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.shared(self.wte(idx)) + self.bias
        for block in (self.block1, self.block2, self.block3):
            x = block(x) + self.bias
        return self.head(self.shared(x))


def x_transformers_lm() -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=SEQ, attn_layers=Decoder(dim=WIDTH, depth=2, heads=2))


def litgpt_lm() -> nn.Module:  # (registers its head before its embedding)
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=WIDTH))


#: decoders written with other libraries, as their users build them (x-transformers and litgpt are
#: test dependencies: absent, their tests skip)
OTHER_LIBRARIES = {"torch": TorchEncoderLM, "x_transformers": x_transformers_lm, "litgpt": litgpt_lm}
