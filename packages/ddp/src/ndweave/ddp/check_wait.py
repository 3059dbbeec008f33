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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ndweave.mesh.lifecycle import announce_failure, failed_ranks, ranks_in_shutdown
from ndweave.mesh.torch_compat import default_store, group_timeout

__all__ = ["CarriedRows", "CheckUnanswered", "RowBoard", "bound_for", "gather_rows", "tell_peers", "wait_bounded"]

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
                bound_s: float, on_slice: Callable[[], None] | None = None) -> dict[int, tuple[int, ...]]:
    """Every rank's ``values`` by global rank (one ``all_gather`` of an int64 row on ``group``, a gloo
    group), or :class:`CheckUnanswered` after ``bound_s`` seconds, or as soon as a peer is seen to have
    left or failed. ``on_slice``: called after each slice the gather did not complete in (it may raise)."""
    if dist.get_backend() == "fake":  # one process pretending: no other rank's row exists
        return {dist.get_rank(): tuple(int(v) for v in values)}
    me = dist.get_rank()
    row = torch.tensor([[me, *values]], dtype=torch.int64)
    parts = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, row, group=group, async_op=True)
    wait_bounded(work, ranks, bound_s=bound_s, keep=[row, *parts], on_slice=on_slice)
    return {r[0]: tuple(r[1:]) for r in torch.cat(parts).tolist()}


def wait_bounded(work: dist.Work, ranks: Sequence[int], *, bound_s: float, keep: Sequence[torch.Tensor],
                 on_slice: Callable[[], None] | None = None) -> None:
    """Wait for ``work`` (a collective of ``ranks`` on a gloo group) in slices of a quarter second: no
    cost when it completes in the first, :class:`CheckUnanswered` once ``bound_s`` has passed or a peer
    has left or failed. ``keep``: the tensors the work uses, kept alive if it is given up on;
    ``on_slice``: called between slices (it may raise)."""
    start, others = time.monotonic(), [r for r in ranks if r != dist.get_rank()]
    while True:
        try:
            work.wait(timeout=_SLICE)  # returns as soon as the collective completes
            return
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
                _outlive_the_interpreter([*keep, work])
                raise CheckUnanswered(waited, left, failed) from None
            if on_slice is not None:
                try:
                    on_slice()
                except BaseException:
                    _outlive_the_interpreter([*keep, work])
                    raise


class CarriedRows:
    """The check's rows carried by a collective the step makes anyway: an all-reduce (a sum) of a
    region laid after the last grad bucket, where each rank writes its row into its own slot and zeros
    elsewhere, so the summed region holds every rank's row. Each int is written as base-256 digits,
    exact in any float dtype the grads have (bfloat16's 8-bit mantissa included): a digit plus zeros is
    that digit. Values are taken modulo 2**32 (they are compared, and named in an error)."""

    DIGITS = 4

    def __init__(self, region: torch.Tensor, index: int, size: int, width: int) -> None:
        self.region = region
        """``size * width * DIGITS`` elements of the grad buffer, after the last bucket."""
        self._index, self._size, self._width = index, size, width

    @classmethod
    def numel(cls, size: int, width: int) -> int:
        return size * width * cls.DIGITS

    def write(self, row: Sequence[int]) -> None:
        # built in Python and copied in once: a few small tensor ops would cost more than the carrying saves
        digits = [0] * self.region.numel()
        start = self._index * self._width * self.DIGITS
        digits[start:start + self._width * self.DIGITS] = [(int(v) % 2**32 >> 8 * d) & 255 for v in row
                                                             for d in range(self.DIGITS)]
        self.region.copy_(torch.tensor(digits, dtype=self.region.dtype))

    def rows(self) -> list[tuple[int, ...]]:
        """Every rank's row, by index in the group (valid once the all-reduce completed)."""
        digits = [int(v) for v in self.region.tolist()]
        values = [sum(digits[i + d] << 8 * d for d in range(self.DIGITS)) for i in range(0, len(digits), self.DIGITS)]
        return [tuple(values[r * self._width:(r + 1) * self._width]) for r in range(self._size)]


class RowBoard:
    """Rows posted in the default group's store by ranks whose check has waited a slice: two ranks
    waiting in different collectives (one in a bucket's all-reduce carrying its row, the other in the
    side group's gather) never complete either, but read each other's row here and raise the same
    error. Nothing is posted while the ranks are in step (a check completes within its first slice)."""

    def __init__(self, name: str, ranks: Sequence[int]) -> None:
        self._keys = {r: f"ndweave/ddp-check/{name}/{r}" for r in ranks}
        self._posted = False

    def post(self, seq: int, row: Sequence[int]) -> None:
        if not self._posted:
            default_store().set(self._keys[dist.get_rank()], ",".join(map(str, (seq, *row))))
            self._posted = True

    def read(self, seq: int) -> dict[int, tuple[int, ...]]:
        """The rows posted for check ``seq``, by global rank (this rank's too, once posted)."""
        store = default_store()
        present = [r for r, key in self._keys.items() if store.check([key])]
        rows = {}
        for rank, text in zip(present, store.multi_get([self._keys[r] for r in present]) if present else []):
            posted_seq, *row = (int(v) for v in text.decode().split(","))
            if posted_seq == seq:  # (an older one: that rank completed the check and is about to clear it)
                rows[rank] = tuple(row)
        return rows

    def clear(self) -> None:
        if self._posted:
            self._posted = False
            try:
                default_store().delete_key(self._keys[dist.get_rank()])
            except (dist.DistError, RuntimeError):
                pass


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
