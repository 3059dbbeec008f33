"""What the trained model does on text it did not train on: the validation loss through the pipeline
(``--eval-every``), and text it writes (``--sample``)."""

from __future__ import annotations

import torch
from torch import nn

from ndweave.mesh import ParallelMesh
from ndweave.pipeline import PipeEngine, generate
from ndweave_gpt.build import MaskedLoss, data_mean, data_rank, loss_scale, to_device
from ndweave_gpt.config import JobConfig
from ndweave_gpt.data import TextData
from ndweave_gpt.data.tokens import TokenData

__all__ = ["PROMPT", "sample", "text_of", "validation_loss"]

#: What ``--sample`` writes after.
PROMPT = b"ROMEO:\n"


def validation_loss(engine: PipeEngine, chunks: list[nn.Module], data: TextData | TokenData, mesh: ParallelMesh,
                    config: JobConfig, loss: MaskedLoss | None = None) -> float:
    """The mean loss on the held-out batch, forward only through the pipeline (every rank); ``loss``
    (``--data``): the engine's, scaled for this batch, then back to the training step's scale."""
    x, y = to_device(data.validation(config.data.global_batch, *data_rank(mesh)), config.parallel.device)
    scale = loss.scale if loss is not None else None
    if loss is not None:
        loss.scale = loss_scale(y, mesh, config)
    for chunk in chunks:
        chunk.eval()
    value = engine.evaluate(x, y).detach().to(torch.float64)
    for chunk in chunks:
        chunk.train()
    if loss is not None:
        loss.scale = scale
    return data_mean(value, mesh)


def sample(engine: PipeEngine, chunks: list[nn.Module], config: JobConfig, prompt: bytes = PROMPT) -> str:
    """``--sample`` bytes the pipelined model writes after ``prompt`` (temperature 0.8, seeded)."""
    for chunk in chunks:
        chunk.eval()
    idx = torch.tensor([list(prompt)], device=config.parallel.device)
    tokens = generate(engine, idx, config.metrics.sample, max_seq_len=config.model.block_size, temperature=0.8,
                      generator=torch.Generator().manual_seed(config.training.seed))
    return text_of(tokens[0].tolist())


def text_of(tokens: list[int]) -> str:
    """The bytes among ``tokens`` as text (a pretrained model's vocabulary may hold more ids)."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
