"""Small single-device models the DModule core tests parallelize (plain torch, no ndweave)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """The seed's MLP, with sizes as parameters."""

    def __init__(self, dim: int = 4, hidden: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class RMSNorm(nn.Module):
    """Hand-written RMSNorm (not nn.RMSNorm): a custom module type with a replicated weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a linear layer whose weight is stored transposed, (in, out)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class NormMLP(nn.Module):
    """Pre-norm residual MLP block with GPT-2 Conv1D projections: TP + sequence parallel target."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.c_fc = Conv1D(hidden, dim)
        self.act = nn.GELU()
        self.c_proj = Conv1D(dim, hidden)
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, x):
        x = x + self.c_proj(self.act(self.c_fc(self.norm(x))))
        return self.ln_f(x)
