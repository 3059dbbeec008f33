"""The few collectives a save or load makes, each one answering for every rank: a rank that fails
sends its error instead of its result, so every rank raises the same error instead of waiting
forever for the one that left. Without a process group (one process) they are local calls.

Each takes the process group to run on (``None``: the default one). An asynchronous save passes a
group of its own, so that its planning can run in a background thread without racing the training
loop's collectives on the default group. The exchange is ``ndweave.mesh.agree.decide_on_first``;
what is checkpoint's own is how a failure travels and which error every rank raises."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ndweave.checkpoint.errors import CheckpointError
from ndweave.mesh.agree import decide_on_first

__all__ = ["broadcast", "coordinate", "is_distributed", "rank", "world_size"]

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


class _Failed:
    """What a rank sends instead of its result when it raised: the traceback as text, and the error
    itself if it is one of ours (they pickle; others may not)."""

    def __init__(self, error: BaseException) -> None:
        self.text = "".join(traceback.format_exception(error)).rstrip()
        self.error = error if isinstance(error, CheckpointError) else None

    def __getstate__(self) -> dict[str, Any]:
        return {"text": self.text, "error": self.error.__reduce__() if self.error is not None else None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.text = state["text"]
        self.error = state["error"][0](*state["error"][1]) if state["error"] is not None else None


def _raise_failures(what: str, everyone: list[Any], own_error: BaseException | None) -> None:
    failed = {r: v for r, v in enumerate(everyone) if isinstance(v, _Failed)}
    if not failed:
        return
    first = failed[min(failed)]
    if first.error is not None:
        raise first.error from own_error
    lines = [f"{what} failed on rank{'s' if len(failed) > 1 else ''} {sorted(failed)}"]
    lines += [f"----- rank {r} -----\n{f.text}" for r, f in failed.items()]
    raise CheckpointError("\n".join(lines)) from own_error


def _attempt(fn: Callable[[], T]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 - sent to every rank, raised there
        return _Failed(error), error


def coordinate(what: str, local: Callable[[], Any], central: Callable[[list[Any]], list[T]],
               group: dist.ProcessGroup | None = None) -> T:
    """DCP's planning pattern: every rank's ``local()`` is gathered on rank 0, which turns them into
    one value per rank (``central(all)``) and scatters them. Returns this rank's value, or raises the
    same error on every rank: the first failed rank's own :class:`CheckpointError` (a damaged file, a
    mismatch) when it raised one, else a ``CheckpointError`` naming each rank that raised, with its
    traceback. Two collectives; no rank receives the others' values."""
    mine, own_error = _attempt(local)

    def decide(everyone: dict[int, Any]) -> dict[int, tuple[str, Any]]:  # on the first rank (rank 0)
        nonlocal own_error
        gathered = list(everyone.values())  # in group rank order
        if not any(isinstance(v, _Failed) for v in gathered):
            result, central_error = _attempt(lambda: central(gathered))
            own_error = own_error or central_error
            gathered = [result] + [None] * (len(gathered) - 1) if central_error is not None else gathered
        if any(isinstance(v, _Failed) for v in gathered):
            return dict.fromkeys(everyone, ("failed", gathered))
        return {r: ("ok", v) for r, v in zip(everyone, result)}

    kind, payload = decide_on_first(group, what, mine, decide)
    if kind == "failed":
        _raise_failures(what, payload, own_error)
    return payload


def broadcast(value: T, group: dist.ProcessGroup | None = None) -> T:
    """Rank 0's ``value`` on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
