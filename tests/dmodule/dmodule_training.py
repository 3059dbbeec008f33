"""The training loop users write, run on a DModule and on its one-process reference side by side."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ndweave.mesh.testing import assert_close


def check_training_parity(model: nn.Module, reference: nn.Module, batches: Iterable, loss_fn: Callable,
                          *, context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                          make_optimizer: Callable = lambda params: torch.optim.AdamW(params, lr=1e-2)) -> None:
    """``make_optimizer`` (AdamW) on both: per batch ``zero_grad(); loss_fn(net, batch).backward(); step()`` (the parallel
    model's loss and backward inside ``context()``), comparing the loss and every gradient each step
    and every parameter at the end, at the default (strict float64) tolerance."""
    optimizer, ref_optimizer = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        with context():
            loss = loss_fn(model, batch)
            loss.backward()
        model.finish_grad_sync()
        ref_optimizer.zero_grad()
        ref_loss = loss_fn(reference, batch)
        ref_loss.backward()
        assert_close(loss, ref_loss, name=f"step {step} loss")
        for name, p in model.named_parameters():
            assert_close(p.grad, reference.get_parameter(name).grad, name=f"step {step} {name}.grad")
        optimizer.step()
        ref_optimizer.step()
    for name, p in model.named_parameters():
        assert_close(p, reference.get_parameter(name), name=name)
