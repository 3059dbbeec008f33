"""Agreement across the PP ranks before a schedule runs: every rank raises the same error, none waits.

torch's schedules trust every rank to hold the same plan and batch: a rank built with another
micro-batch count waits forever for a message that never comes, and a batch whose shape differs from
the first step's (when torch inferred the activation shapes) is received into buffers of the old size
(gloo aborts the process, or a smaller one is read silently). Each rank sends what it holds (its plan,
its batch's shapes, or the error its own checks raised) to every PP rank: the plan once through
``ndweave.mesh.agree.agree_or_raise``, the batch every step as a few ints in one ``gather_ints``;
every rank then reaches the same verdict.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ndweave.mesh.agree import agree_or_raise, gather, gather_ints

__all__ = ["BatchShapes", "agree_on_batch", "agree_on_plan", "every_pp_rank"]

T = TypeVar("T")
_MAX_DIMS = 8  # of a batch tensor, in the per-step gather


def every_pp_rank(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank of ``group``'s ``value``, indexed by its rank in the group (the PP rank)."""
    table = gather(group, value)
    return [table[rank] for rank in dist.get_process_group_ranks(group)] if len(table) > 1 else list(table.values())


def agree_on_plan(plan: Any, group: dist.ProcessGroup, local_checks: Callable[[], T]) -> tuple[T, str]:
    """Run ``local_checks()`` (no communication), then agree with every PP rank
    (:func:`ndweave.mesh.agree.agree_or_raise`): raise on every rank the first failing rank's error
    (its type, the rank named), or a ``RankMismatchError`` (a ``ValueError``) naming the ranks and the
    plan field that differs. Returns what ``local_checks`` returned, and the lowest rank's random id
    for the engine (the same on every PP rank: its failure record's key)."""
    fields = {f.name: repr(getattr(plan, f.name)) for f in dataclasses.fields(plan)}
    result, ids = agree_or_raise(group, "PipeEngine", lambda: (local_checks(), {"plan": fields, "local": uuid.uuid4().hex}),
                                 hint="every PP rank must build the engine from the same PipelineParallelPlan (a "
                                      "schedule over different plans waits forever)")
    return result, ids[min(ids)]


@dataclasses.dataclass
class BatchShapes:
    """The shapes of the first step's batch: torch's stages fix their activation buffers from them."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...] | None
    """``None`` for a ``loss_fn(output)`` that takes no targets."""


def _batch_row(error: str | None, shapes: tuple[tuple[int, ...] | None, ...]) -> list[int]:
    """This rank's batch check as ints: [failed, then per shape its ndim (-1: none) and dims, padded]."""
    row = [int(error is not None)]
    for shape in shapes:
        dims = list(shape) if shape is not None and len(shape) <= _MAX_DIMS else None  # (too many: an error)
        row += [-1 if dims is None else len(dims)] + (dims or []) + [0] * (_MAX_DIMS - len(dims or []))
    return row


def _shape_of(row: list[int], index: int) -> tuple[int, ...] | None:
    start = 1 + index * (_MAX_DIMS + 1)
    ndim = row[start]
    return None if ndim < 0 else tuple(row[start + 1:start + 1 + ndim])


def agree_on_batch(error: str | None, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                   group: dist.ProcessGroup | None, first_step: BatchShapes | None,
                   device: torch.device | str = "cpu") -> BatchShapes:
    """Every PP rank's batch check, on every PP rank: this rank's ``error`` (from its local checks), the
    first stage's inputs shape and the last stage's targets shape. Raises the same ``ValueError`` on
    every rank if any rank's check failed, the targets hold other samples than the inputs, or a shape
    differs from the first step's; returns this step's shapes.

    It runs every step, so it is one all-gather of a few ints on ``device`` (where ``group``
    communicates); the error messages travel in a second gather only when some rank failed."""
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (inputs, targets)]
    if error is None and any(s is not None and len(s) > _MAX_DIMS for s in shapes):
        error = f"a batch of more than {_MAX_DIMS} dims: {[s for s in shapes if s is not None]}"
    mine = _batch_row(error, shapes)
    if group is None or dist.get_world_size(group) == 1:
        rows = [mine]
    else:  # in PP rank order (the group's)
        rows = [list(row) for row in gather_ints(group, mine, device=device).values()]
    failed = [rank for rank, row in enumerate(rows) if row[0]]
    if failed:
        messages = every_pp_rank(error, group)
        raise ValueError(f"PipeEngine step refused on PP rank {failed[0]}: {messages[failed[0]]}")
    inputs_shape = next(s for s in (_shape_of(r, 0) for r in rows) if s is not None)
    # None: a loss_fn(output) without targets
    targets_shape = next((s for s in (_shape_of(r, 1) for r in rows) if s is not None), None)
    if targets_shape is not None and targets_shape[0] % inputs_shape[0]:
        raise ValueError(
            f"PipeEngine: targets of shape {targets_shape} (last stage) do not belong to inputs of shape "
            f"{inputs_shape} (first stage): the targets' dim 0 must hold the inputs' samples (or a multiple: "
            "targets flattened per sample); give every PP rank the same mini-batch"
        )
    now = BatchShapes(inputs_shape, targets_shape)
    if first_step is not None and now != first_step:
        raise ValueError(
            f"PipeEngine: this step's batch has inputs {now.inputs}, targets {now.targets}, but the first step's "
            f"had inputs {first_step.inputs}, targets {first_step.targets}; the stages' activation shapes are "
            "fixed at the first step: keep one batch shape (a DataLoader with drop_last=True) or build a new "
            "PipeEngine for another shape"
        )
    return now
