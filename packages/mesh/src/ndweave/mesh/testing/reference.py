"""The one single-process reference loop every parity check compares against.

"Equal to one process" is only a claim if "one process" means one thing: the seeds' loop (zero the
grads, forward, the loss outside the model against plain targets, backward, clip, step), with the
options a parallel run can change the summation order of (micro-batches) or the precision of (fp32
master weights for low-precision params). Every package test, the integration tests and the GPT
job's ``--compare-single-device`` train their reference through :func:`train_one_process`::

    run = train_one_process(model, batches, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                            loss_fn=F.cross_entropy, clip=1.0, keep_grads=True)
    run.losses[-1], run.grads[0]["fc1.weight"], run.final["fc2.bias"]
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["ReferenceRun", "train_one_process"]


@dataclass
class ReferenceRun:
    """What one process made of the data."""

    losses: list[float] = field(default_factory=list)
    """Per step, the batch's loss (the mean of its micro-batches' losses)."""
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step, ``{fqn: grad}`` after backward, before clipping (``keep_grads=True``; tied
    parameters under every name)."""
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """``{fqn: param}`` after every step (``keep_params="every"``) or after the last one only."""

    @property
    def final(self) -> dict[str, torch.Tensor]:
        """``{fqn: param}`` after the last step."""
        return self.params[-1]


def _named(model: nn.Module, of: Callable[[torch.Tensor], torch.Tensor | None]) -> dict[str, torch.Tensor]:
    return {n: of(p) for n, p in model.named_parameters(remove_duplicate=False)}


def _chunk(x: Any, parts: int) -> list[Any]:
    """``x`` (a tensor, or a tuple or dict of them) as ``parts`` micro-batches along dim 0."""
    if isinstance(x, dict):
        pieces = {k: v.chunk(parts) for k, v in x.items()}
        return [{k: v[i] for k, v in pieces.items()} for i in range(parts)]
    if isinstance(x, (tuple, list)):
        return [type(x)(p) for p in zip(*(v.chunk(parts) for v in x), strict=True)]
    return list(x.chunk(parts))


def _call(model: nn.Module, x: Any) -> Any:
    """``model`` on a micro-batch as a pipeline stage takes it: keyword inputs, positional ones, or one tensor."""
    return model(**x) if isinstance(x, dict) else model(*x) if isinstance(x, (tuple, list)) else model(x)


def train_one_process(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    *,
    optimizer: torch.optim.Optimizer | Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    model_loss: Callable[[nn.Module, Any, Any], torch.Tensor] | None = None,
    micro_batches: int = 1,
    clip: float = 0.0,
    fp32_masters: bool = False,
    scheduler: Callable[[torch.optim.Optimizer], Any] | Any = None,
    keep_grads: bool = False,
    keep_params: Literal["final", "every"] = "final",
    copy_model: bool = False,
    on_step: Callable[[int, nn.Module], None] | None = None,
) -> ReferenceRun:
    """Train ``model`` on ``batches`` (``(x, y)`` pairs) in this process, the seeds' way.

    Args:
        model: trained in place (``copy_model=True``: a deep copy is, ``model`` is left as it was).
        batches: ``(x, y)`` per step; ``x`` and ``y`` are split along dim 0 into ``micro_batches``.
            ``x`` may be a tensor, or a tuple or dict of them (each split alike); ``model(x)`` is then
            called as ``model(*x)`` or ``model(**x)``.
        optimizer: an optimizer over ``model``'s parameters, or a function of the parameters it
            steps that builds one (needed with ``fp32_masters`` or ``copy_model``).
        loss_fn: ``loss_fn(model(x), y)``, the loss outside the model (the default way).
        model_loss: ``model_loss(model, x, y)`` instead, for models that compute their own loss.
        micro_batches: each batch's grad accumulated over this many equal parts, each loss divided
            by their number: the same math summed in another order.
        clip: ``clip_grad_norm_`` to this total 2-norm before each step (0: none).
        fp32_masters: bf16/fp16 parameters get fp32 master copies the optimizer steps (their grads
            cast up, the masters written back), as a ZeRO optimizer does.
        scheduler: an lr scheduler, or a function of the optimizer making one; stepped after each step.
        keep_grads: record every step's grads in :attr:`ReferenceRun.grads`.
        keep_params: ``"every"``: the params after each step; ``"final"``: after the last only.
        copy_model: train a deep copy.
        on_step: called as ``on_step(step_index, model)`` after each step (a validation loss, a log).
    """
    if (loss_fn is None) == (model_loss is None):
        raise ValueError("train_one_process: pass loss_fn(output, y) or model_loss(model, x, y), one of them")
    if copy_model:
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("train_one_process(copy_model=True) needs optimizer as a function of the params")
        model = copy.deepcopy(model)
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() if fp32_masters and p.dtype in (torch.bfloat16, torch.float16)
               else p for p in params]
    if isinstance(optimizer, torch.optim.Optimizer):
        if any(m is not p for m, p in zip(masters, params)):
            raise ValueError("train_one_process(fp32_masters=True) needs optimizer as a function of the params")
        opt = optimizer
    else:
        opt = optimizer(masters)
    sched = scheduler(opt) if callable(scheduler) else scheduler
    run = ReferenceRun()
    for index, (x, y) in enumerate(batches):
        opt.zero_grad()
        model.zero_grad()
        total = None  # summed in the loss's dtype, as a parallel run's micro-batch losses are
        for xs, ys in zip(_chunk(x, micro_batches), y.chunk(micro_batches), strict=True):
            loss = (model_loss(model, xs, ys) if model_loss else loss_fn(_call(model, xs), ys)) / micro_batches
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        run.losses.append(total.item())
        if keep_grads:
            run.grads.append(_named(model, lambda p: None if p.grad is None else p.grad.clone()))
        for p, master in zip(params, masters):
            if master is not p:
                master.grad = p.grad.float()
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        with torch.no_grad():
            for p, master in zip(params, masters):
                if master is not p:
                    p.copy_(master)
        if sched is not None:
            sched.step()
        if keep_params == "every":
            run.params.append(_named(model, lambda p: p.detach().clone()))
        if on_step is not None:
            on_step(index, model)
    if keep_params != "every":
        run.params.append(_named(model, lambda p: p.detach().clone()))
    return run
