"""What the trained model does on text it did not train on: the validation loss through the pipeline
(``--eval-every``), and text it writes (``--sample``)."""

from __future__ import annotations

import torch
from torch import nn

from ndweave.mesh import ParallelMesh
from ndweave.pipeline import PipeEngine, generate
from ndweave_gpt.build import (Parallel, attending, build_data, build_model, context_batch, data_mean, data_rank,
                               global_tokens, loss_scale, to_device)
from ndweave_gpt.config import JobConfig
from ndweave_gpt.data import TextData
from ndweave_gpt.data.tokens import TokenData

__all__ = ["sample", "sample_final", "sample_one_process", "validation_loss"]


def validation_loss(job: Parallel, data: TextData | TokenData, mesh: ParallelMesh, config: JobConfig) -> float:
    """The mean loss on the held-out batch, forward only through the pipeline (every rank); ``job.loss``
    (``--data``): the engine's, scaled for this batch, then back to the training step's scale."""
    x, y = to_device(data.validation(config.data.global_batch, *data_rank(mesh)), config.parallel.device)
    x, y = context_batch(job.cp, x, y)
    loss = job.loss
    scale = loss.scale if loss is not None else None
    if loss is not None:
        loss.scale = loss_scale(global_tokens(y, 0, mesh)[0], mesh, config)
    for chunk in job.chunks:
        chunk.eval()
    with attending(job.cp):
        value = job.engine.evaluate(x, y).detach().to(torch.float64)
    for chunk in job.chunks:
        chunk.train()
    if loss is not None:
        loss.scale = scale
    return data_mean(value, mesh)


def sample(engine: PipeEngine, chunks: list[nn.Module], config: JobConfig, data: TextData) -> str:
    """``--sample`` tokens the pipelined model writes after the data's prompt (temperature 0.8, seeded)."""
    for chunk in chunks:
        chunk.eval()
    idx = torch.tensor([data.prompt], device=config.parallel.device)
    tokens = generate(engine, idx, config.metrics.sample, max_seq_len=config.model.block_size, temperature=0.8,
                      generator=torch.Generator().manual_seed(config.training.seed))
    return data.text(tokens[0].tolist())


def sample_one_process(model: nn.Module, config: JobConfig, data: TextData | TokenData) -> str:
    """What :func:`sample` writes, from the whole model on this process: the reference's, and the job's
    with ``--data`` (the pipeline's stages take the packed batch's mask, which generation has not)."""
    model.eval()
    idx = torch.tensor([data.prompt], device=config.parallel.device)
    g = torch.Generator().manual_seed(config.training.seed)
    block = config.model.block_size
    with torch.no_grad():
        for _ in range(config.metrics.sample):
            logits = model(idx[:, -block:])[0][0, -1].double() / 0.8  # temperature 0.8
            picked = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=g)
            idx = torch.cat([idx, picked[None].to(idx.device)], 1)
    return data.text(idx[0].tolist())


def sample_final(params: dict[str, torch.Tensor], config: JobConfig) -> str:
    """``--sample`` with ``--data`` or a ``cp`` dim, on one process (rank 0, after the run): the model built
    again with the run's final parameters (``params``, gathered by FQN), writing after the data's prompt."""
    model = build_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return sample_one_process(model.to(config.parallel.device), config, build_data(config))
