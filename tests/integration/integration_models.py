"""Models and the single-process reference loop shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ndweave.mesh.testing import train_one_process
from ndweave_gpt.models.nanogpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]


class MLP(nn.Module):
    """The seed's MLP (DModule doc)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(self.relu(self.fc1(x))), y)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    # the job's GPT (ndweave_gpt, installed in the integration environment); bias=False: a key-projection
    # bias has an exactly-zero true gradient (softmax ignores a constant per query), so Adam would turn
    # two runs' different rounding noise into full-size steps.
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=False))


def batches(kind: str, steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(steps)]
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (batch, 9), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def loss_of(output) -> torch.Tensor:
    """nanoGPT returns ``(logits, loss)``; the MLP returns the loss."""
    return output[1] if isinstance(output, tuple) else output


def train_reference(model: nn.Module, data, opt_cls, opt_kwargs, clip: float) -> list[float]:
    return train_one_process(model, data, optimizer=lambda params: opt_cls(params, **opt_kwargs),
                             model_loss=lambda m, x, y: loss_of(m(x, y)), clip=clip).losses