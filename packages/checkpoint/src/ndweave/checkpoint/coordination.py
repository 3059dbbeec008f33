"""The few collectives a save or load makes, each one answering for every rank: a rank that fails
sends its error instead of its result, so every rank raises the same error instead of waiting
forever for the one that left. Without a process group (one process) they are local calls."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ndweave.checkpoint.errors import CheckpointError

__all__ = ["agree", "broadcast", "is_distributed", "rank", "world_size"]

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


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


def agree(what: str, fn: Callable[[], T]) -> list[T]:
    """Every rank's ``fn()`` (all-gathered), or the same error on every rank: the first failed rank's
    own :class:`CheckpointError` (a damaged file, a mismatch) when it raised one, else a
    ``CheckpointError`` naming each rank that raised, with its traceback."""
    own_error = None
    try:
        mine: Any = fn()
    except Exception as error:  # noqa: BLE001 - sent to every rank, raised below
        own_error, mine = error, _Failed(error)
    everyone: list[Any] = [mine]
    if is_distributed():
        everyone = [None] * world_size()
        dist.all_gather_object(everyone, mine)
    failed = {r: v for r, v in enumerate(everyone) if isinstance(v, _Failed)}
    if failed:
        first = failed[min(failed)]
        if first.error is not None:
            raise first.error from own_error
        lines = [f"{what} failed on rank{'s' if len(failed) > 1 else ''} {sorted(failed)}"]
        lines += [f"----- rank {r} -----\n{f.text}" for r, f in failed.items()]
        raise CheckpointError("\n".join(lines)) from own_error
    return everyone


def broadcast(value: T) -> T:
    """Rank 0's ``value`` on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
