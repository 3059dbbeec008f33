"""A model cut without ``example_inputs`` tried at construction, so that a cut that cannot run fails
there, naming what to pass, and never later inside a stage's forward.

Cut without shapes, every stage runs the model's whole ``forward`` with other stages' layers handing
their input through (:class:`~ndweave.pipeline.construct.StagePlaceholder`). That holds for forwards
that only call their layers on the hidden states (HF's, a loop over ``self.layers``), and not for
those that read the input as ids on the way (nanoGPT's ``b, t = idx.size()``, litgpt's and
x-transformers' position handling): there stage 1 meets hidden states where the forward expects ids.
Which kind a forward is shows only when it runs, so it runs here, on fake tensors (shapes without
memory or compute), on a guessed micro-batch: token ids when the model holds an embedding. Where
no guess can be made, or the whole model does not run on the guess, nothing is said (the guess, not
the cut, is wrong).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ndweave.mesh.torch_compat import FakeTensorMode
from ndweave.pipeline.stage_io import first_tensor

__all__ = ["check_stages_run"]

#: the guessed micro-batch: 1 sample of 4 tokens (within any model's context)
_GUESS_SHAPE = (1, 4)


def check_stages_run(model: nn.Module, chunk_of: Callable[[int], nn.Module], num_stages: int) -> None:
    """Run each stage's chunk (``chunk_of(stage)``) after the one before, as the engine does, on a
    guessed micro-batch; raise where a stage cannot run on what the stage before hands it."""
    guess = _guess_inputs(model)
    if guess is None:
        return
    with _quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
        try:
            model(guess)
        except Exception:  # noqa: BLE001  (the guess does not fit this model: no verdict)
            return
        x = guess
        for stage in range(num_stages):
            chunk = chunk_of(stage)
            try:
                out = chunk(x)
            except Exception as e:  # noqa: BLE001  (any failure here is the cut's)
                given = f"what stage {stage - 1} hands it" if stage else "the model's input"
                raise ValueError(
                    f"{type(model).__name__} cannot be pipelined without example_inputs: cut without shapes, stage "
                    f"{stage} runs the model's whole forward with the layers of other stages handing their input "
                    f"through, and that forward fails on {given} ({type(e).__name__}: {_first_line(e)} at "
                    f"{_where(e)}); pass example_inputs= (one micro-batch) to construct_pipeline_stage, which cuts "
                    "the forward where its layers run"
                ) from None
            try:
                x = first_tensor(out)
            except TypeError:
                return  # (the engine says what a stage must output)


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """Fake tensors log every op that fails as an error before raising it; here a failure is an answer."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _guess_inputs(model: nn.Module) -> torch.Tensor | None:
    """Token ids when the model holds an embedding (whichever layer comes first: litgpt registers its
    head before its embedding), else ``None``."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        return None
    return torch.zeros(_GUESS_SHAPE, dtype=torch.long, device=embedding.weight.device)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def _where(e: BaseException) -> str:
    """The innermost frame outside torch: the model's line that failed."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename]
    frame = frames[-1] if frames else traceback.extract_tb(e.__traceback__)[-1]
    return f"{frame.filename}:{frame.lineno}"
