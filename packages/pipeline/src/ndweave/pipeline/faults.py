"""A step that raises on one PP rank raises on every PP rank, within seconds, naming that rank.

torch's schedules block in receives: when a stage's forward, backward or loss raises on one rank, the
others wait for activations or grads that never come, until the process-group timeout. So:

* the engine runs on a process group of its own over the PP ranks (the mesh's is left alone);
* a rank whose step raises publishes what failed in the c10d store (the first record wins), then
  aborts that group and drops every reference to it: gloo closes its connections when the group is
  freed (a peer waiting on a receive from this rank fails at once), NCCL aborts its communicators;
* a rank whose communication fails reads the record, and aborts its group in turn (so that the
  ranks waiting on *it* fail too: the failure travels along the pipeline in milliseconds per hop);
* every rank raises :class:`PipelineStageError` naming the failing PP rank, the part of the step
  and its message. On the failing rank its ``__cause__`` is the original error, its traceback kept
  as text (the frames go: torch's schedules hold their pending sends and receives in them).
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType

import torch.distributed as dist
from torch import nn

from ndweave.mesh.torch_compat import default_store

__all__ = ["Blame", "Failure", "FailureRecord", "PipelineStageError", "describe_error", "detach_traceback"]

#: Seconds a rank whose communication failed waits for a peer's record before it reports the
#: communication error as its own (a peer that raised publishes before it aborts, so the record is
#: normally there already; it never comes when a rank died).
RECORD_GRACE_S = 3.0
_MAX_MESSAGE = 4000  # characters of an error message kept in the store


@dataclasses.dataclass(frozen=True)
class Failure:
    """What failed, as every PP rank reads it."""

    pp_rank: int
    """The failing rank's index in the PP group."""
    rank: int
    """Its global rank."""
    where: str
    """The part of the step that raised: ``"the forward of micro-batch 1 on stage 2, in module
    layers.3.fc"``, ``"loss_fn on micro-batch 0 (stage 3, the last)"``, ..."""
    error: str
    """The error's type and message: ``"ValueError: ..."``."""


class PipelineStageError(RuntimeError):
    """A ``PipeEngine`` step raised on a PP rank; raised on every PP rank of that pipeline.

    ::

        try:
            loss = engine(x, y)
        except PipelineStageError as e:   # on every PP rank, within seconds
            print(e.failure.pp_rank, e.failure.where, e.failure.error)
            raise

    On the rank that failed, ``__cause__`` is the original error, its traceback kept as text in a
    note; elsewhere it is the communication error that ended the wait. The engine cannot run again (its calls raise this
    error again); the mesh's groups are left alone, so a new ``PipeEngine`` over the same mesh can.
    """

    def __init__(self, failure: Failure, *, again: bool = False) -> None:
        self.failure = failure
        head = "PipeEngine: an earlier step failed" if again else "PipeEngine step failed"
        super().__init__(
            f"{head} on PP rank {failure.pp_rank} (rank {failure.rank}), in {failure.where}: {failure.error}\n"
            "Every PP rank raises this error; the engine's own process group is aborted, so this engine cannot "
            "run again: build a new PipeEngine (and zero the grads: this step's are partial)"
        )


class Blame:
    """Which part of the step this rank was running when an exception left it (the first one)."""

    def __init__(self) -> None:
        self.part: tuple[str, int | None, int | None] | None = None

    def reset(self) -> None:
        self.part = None

    @contextmanager
    def running(self, kind: str, stage: int | None = None, micro_batch: int | None = None) -> Iterator[None]:
        try:
            yield
        except Exception:
            if self.part is None:
                self.part = (kind, stage, micro_batch)
            raise

    def describe(self, error: BaseException, chunk_of_stage) -> str | None:
        """The blamed part in words (with the module that raised, for a forward), or ``None``:
        the exception came from the step's communication."""
        if self.part is None:
            return None
        kind, stage, micro_batch = self.part
        if stage is None:
            return kind
        if micro_batch is None:  # torch runs each stage's forward once at the first step to infer shapes
            where = f"the {kind} of stage {stage} (the first step's shape inference)"
        elif kind == "loss_fn":
            where = f"loss_fn on micro-batch {micro_batch} (stage {stage}, the last)"
        else:
            where = f"the {kind} of micro-batch {micro_batch} on stage {stage}"
        module = _raising_module(_root(error), chunk_of_stage(stage)) if kind == "forward" else None
        return f"{where}, in module {module}" if module else where


class FailureRecord:
    """The entry in the c10d store where an engine's first failed step is published."""

    def __init__(self, engine_id: str, pp_rank: int, pp_size: int) -> None:
        self.pp_rank = pp_rank
        self.rank = dist.get_rank()
        self.key = f"ndweave.pipeline/{engine_id}/failure" if pp_size > 1 else None

    def read(self) -> Failure | None:
        if self.key is None or not default_store().check([self.key]):
            return None
        return Failure(**json.loads(default_store().get(self.key)))

    def settle(self, error: BaseException, where: str | None) -> Failure:
        """The step's failure as every PP rank reports it: a record already published (this rank's
        error came after it), else this rank's own, published for the others. ``where`` ``None``
        (a communication error): a peer's record, waited for a little."""
        found = self.read() or (self._wait() if where is None else None)
        if found is not None:
            return found
        where = where or "communication with the other PP ranks (none reported an error: did a rank die?)"
        mine = Failure(self.pp_rank, self.rank, where, describe_error(error))
        if self.key is None:
            return mine
        winner = default_store().compare_set(self.key, "", json.dumps(dataclasses.asdict(mine)))
        return Failure(**json.loads(winner))

    def _wait(self) -> Failure | None:
        if self.key is None:
            return None
        try:
            default_store().wait([self.key], timedelta(seconds=RECORD_GRACE_S))
        except dist.DistStoreError:
            return None
        return self.read()


def describe_error(error: BaseException) -> str:
    """``"Type: message"`` of the error the user's code raised (torch's stage wraps a forward's error
    in a ``RuntimeError`` of its own: the wrapped one is meant)."""
    root = _root(error)
    text = f"{type(root).__name__}: {root}"
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " [...]"


def _root(error: BaseException) -> BaseException:
    while error.__cause__ is not None and _raised_in(error.__traceback__, "torch.distributed.pipelining"):
        error = error.__cause__
    return error


def _raised_in(tb: TracebackType | None, package: str) -> bool:
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_globals.get("__name__", "").startswith(package)


def _raising_module(error: BaseException, chunk: nn.Module | None) -> str | None:
    """The FQN of the innermost module of ``chunk`` whose code is in ``error``'s traceback."""
    if chunk is None:
        return None
    names = {id(module): name for name, module in chunk.named_modules(remove_duplicate=False) if name}
    found, tb = None, error.__traceback__
    while tb is not None:
        found = names.get(id(tb.tb_frame.f_locals.get("self")), found)
        tb = tb.tb_next
    return found


def detach_traceback(error: BaseException) -> BaseException:
    """The error to chain to :class:`PipelineStageError`: the one the user's code raised (unwrapped from
    torch's stage), its traceback kept as text in a note. Every traceback of ``error``'s chain is
    dropped: their frames hold the schedule's pending sends and receives (torch's runtime schedules
    hold them in closures, which clearing a frame leaves alone), and the group's connections close
    only once those are freed."""
    text = "".join(traceback.format_exception(error)).rstrip()
    root = _root(error)
    pending, seen = [error], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        pending += [e.__cause__, e.__context__]
    notes = getattr(root, "__notes__", None)
    note = f"The traceback on this rank (kept as text: its frames are released with the step):\n{text}"
    root.__notes__ = [*notes, note] if isinstance(notes, list) else [note]  # (add_note: Python 3.11+)
    return root
