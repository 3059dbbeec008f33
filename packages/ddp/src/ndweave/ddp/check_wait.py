"""The DP ranks' per-step check, gathered with a bound: a rank whose peers never come to it learns so
within DDP's ``desync_timeout`` (60 s), or at once where a peer has said it left (``shutdown()``) or failed.

The check is one ``all_gather`` of a few ints on a gloo side group. Waiting for it with the group's
own timeout (300 s by default) left a rank that stepped once more than the others blocked for five
minutes, and its peers with it. So the gather is waited for in slices of a quarter second: a slice ends
the moment the gather completes (no cost when the ranks are in step), and between slices this rank
reads the store for peers that called ``shutdown()`` or announced a failure
(``ndweave.mesh.lifecycle``). A rank that gives up announces its own failure there, so a peer waiting
in ``shutdown()`` names it at once instead of waiting out its own timeout.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ndweave.mesh.lifecycle import announce_failure, failed_ranks, ranks_in_shutdown
from ndweave.mesh.torch_compat import group_timeout

__all__ = ["CheckUnanswered", "bound_for", "gather_rows", "tell_peers"]

# how long one wait for the gather lasts before the store is read for peers that left or failed
_SLICE = timedelta(seconds=0.25)
_WAIT_TIMED_OUT = "Operation timed out!"  # what torch's Work.wait(timeout) raises when a slice ends


@dataclass
class CheckUnanswered(Exception):
    """The gather did not complete: how long this rank waited, and what it knows of its peers."""

    waited_s: float
    left: list[int] = field(default_factory=list)
    """Peers that had called ``shutdown()``."""
    failed: dict[int, str] = field(default_factory=dict)
    """Peers that announced a failure, with their error."""
    error: str = ""
    """The collective's own error (gloo's: a peer's connection closed), if it ended so."""


def bound_for(group: dist.ProcessGroup, first: bool, timeout_s: float) -> float:
    """Seconds to wait at a check on ``group``: the group's timeout for the ``first`` one (the first
    step's compilation and loading may keep ranks apart longer), then at most ``timeout_s`` (a group
    with a shorter timeout keeps its own)."""
    own = group_timeout(group)
    own_s = own.total_seconds() if own is not None else float("inf")
    return own_s if first else min(own_s, timeout_s)


def gather_rows(group: dist.ProcessGroup, ranks: Sequence[int], values: Sequence[int], *,
                bound_s: float) -> dict[int, tuple[int, ...]]:
    """Every rank's ``values`` by global rank (one ``all_gather`` of an int64 row on ``group``, a gloo
    group), or :class:`CheckUnanswered` after ``bound_s`` seconds, or as soon as a peer is seen to have
    left or failed."""
    if dist.get_backend() == "fake":  # one process pretending: no other rank's row exists
        return {dist.get_rank(): tuple(int(v) for v in values)}
    me = dist.get_rank()
    row = torch.tensor([[me, *values]], dtype=torch.int64)
    parts = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, row, group=group, async_op=True)
    start, others = time.monotonic(), [r for r in ranks if r != me]
    while True:
        try:
            work.wait(timeout=_SLICE)  # returns as soon as the gather completes
            break
        except RuntimeError as error:
            waited = time.monotonic() - start
            if _WAIT_TIMED_OUT not in str(error):  # gloo's own end: a peer's connection closed, or its timeout
                failed = failed_ranks(others)
                said = (str(error).splitlines() or [type(error).__name__])[0].split(". This is typically")[0]
                raise CheckUnanswered(waited, [r for r in ranks_in_shutdown(others) if r not in failed], failed,
                                      said) from error
            failed = failed_ranks(others)
            left = [r for r in ranks_in_shutdown(others) if r not in failed]
            if failed or left or waited >= bound_s:
                _outlive_the_interpreter([row, *parts, work])
                raise CheckUnanswered(waited, left, failed) from None
    return {r[0]: tuple(r[1:]) for r in torch.cat(parts).tolist()}


def _outlive_the_interpreter(objects: list) -> None:
    """Leak a reference to the work and the tensors of a gather left pending, so none is ever freed.

    The gather ends when its peers' connections close, often after this rank gave up and while its
    interpreter is ending: gloo's thread then releases the work, and freeing a work or a tensor that
    Python let go of needs the GIL there, which ends that thread and aborts the process ("terminate
    called without an active exception", SIGABRT, seen in 3 of 6 launches under load; see
    ``ndweave.mesh.lifecycle``). What Python still holds is not freed there. A few ints, once per
    failed check."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def tell_peers(error: BaseException) -> BaseException:
    """Announce ``error`` to the other ranks (``ndweave.mesh.lifecycle.announce_failure``) and return it:
    a peer waiting in ``shutdown()`` or at a check then names this rank and its error at once."""
    announce_failure(f"{type(error).__name__}: {error}")
    return error
