"""Forward-only passes of a mini-batch through torch's schedule: a validation loss, or the outputs.

torch's schedules run forward-only through ``schedule.eval(...)`` (torchtitan's ``validate.py``
does the same): the micro-batches flow through the stages as in training, with no backward and no
activations kept for one (the engine runs it under ``no_grad``, so a data-parallel wrapper counts no
forward it would wait a backward for). A failure on one PP rank raises ``PipelineStageError`` on
every PP rank, as in training. torch re-infers the stages' buffers when a schedule switches
between training and evaluation, so an evaluation batch may have another shape than the training
batch; every evaluation batch must have the first one's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ndweave.pipeline.agree import every_pp_rank
from ndweave.pipeline.inputs import ModelInputs, check_inputs, check_targets, input_shapes

if TYPE_CHECKING:
    from ndweave.pipeline.engine import PipeEngine

__all__ = ["evaluate_batch"]


def evaluate_batch(engine: PipeEngine, inputs: ModelInputs | None, targets: torch.Tensor | None):
    """What :meth:`PipeEngine.evaluate` returns: the mean micro-batch loss on every PP rank when the
    last stage is given ``targets``, else the last stage's outputs (the micro-batches' concatenated
    along dim 0) on the rank holding it and ``None`` on the others."""
    engine._check_usable()
    first = 0 in engine.module.stage_indices
    last = engine.resolved.num_stages - 1 in engine.module.stage_indices
    shapes, with_targets = _agree_on_batch(engine, inputs, targets, first, last)
    _check_same_shape(engine, shapes)
    recording, engine.recorder.enabled = engine.recorder.enabled, False  # the timeline is training's
    engine._blame.reset()
    try:
        args = engine._feed(inputs, check_inputs(inputs, engine.resolved.num_microbatches)) if first else ()
        return _run(engine, args, targets if last else None, with_targets, next(iter(shapes.values()))[0], last)
    except Exception as failed:  # raised on every PP rank, as a training step's failure is
        engine._fail(failed)
    finally:
        engine.recorder.enabled = recording


def _agree_on_batch(engine: PipeEngine, inputs, targets, first: bool,
                    last: bool) -> tuple[dict[str, tuple[int, ...]], bool]:
    """Every PP rank's batch check, each input's shape and whether the last stage has targets, on
    every PP rank (one small gather): all raise, or all run the same schedule."""
    try:
        if first:  # (the first evaluation's shapes are compared after the gather, on every rank)
            engine._check_model_inputs(inputs, None)
        if last and targets is not None:
            check_targets(targets, engine.resolved.num_microbatches)
        error = None
    except ValueError as local:
        error = str(local)
    shapes = (input_shapes(inputs) if first and error is None else None,
              last and targets is not None and error is None)
    try:
        everyone = every_pp_rank((error, shapes), engine._group)
    except Exception as failed:  # a peer failed after its part of the last step
        engine._fail(failed)
    failed = [(rank, message) for rank, (message, _) in enumerate(everyone) if message]
    if failed:
        raise ValueError(f"PipeEngine.evaluate refused on PP rank {failed[0][0]}: {failed[0][1]}")
    return next(s[0] for _, s in everyone if s[0] is not None), any(s[1] for _, s in everyone)


def _run(engine: PipeEngine, args: tuple, targets, with_targets: bool, batch: int, last: bool):
    with torch.no_grad():
        if with_targets:
            losses: list[torch.Tensor] = []
            engine.schedule.eval(*args, target=targets, losses=losses)
            return engine._broadcast_loss(losses, last)
        # no targets: the schedule still calls its loss on each micro-batch; it gets a placeholder
        # target of the batch's length and gives no loss
        loss_fn, engine.loss_fn = engine.loss_fn, _no_loss
        try:
            placeholder = torch.empty((batch, 0), device=engine.stages[0].device) if last else None
            outputs = engine.schedule.eval(*args, target=placeholder)
        finally:
            engine.loss_fn = loss_fn
        return outputs if last else None


def _no_loss(output, target=None) -> torch.Tensor:
    return torch.zeros(())


def _check_same_shape(engine: PipeEngine, shapes: dict[str, tuple[int, ...]]) -> None:
    """torch sized the stages' evaluation buffers at the first evaluation: keep that batch shape."""
    first = engine.__dict__.setdefault("_first_eval_inputs", shapes)
    if shapes != first:
        raise ValueError(
            f"PipeEngine.evaluate: these inputs have shape {_shown(shapes)}, the first evaluation's had "
            f"{_shown(first)}; the stages' buffers are sized at the first evaluation: keep one evaluation batch "
            "shape (a DataLoader with drop_last=True)"
        )


def _shown(shapes: dict[str, tuple[int, ...]]) -> object:
    return shapes["inputs"] if list(shapes) == ["inputs"] else shapes  # one tensor: its shape alone
