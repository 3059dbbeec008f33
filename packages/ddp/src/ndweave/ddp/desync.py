"""Catching data-parallel ranks that stopped doing the same thing, before they wait on each other.

Every DP rank must run the same forwards, backwards and grad syncs. When one does not (it skipped a
``backward()``, called ``step()`` once more, entered ``no_sync()`` alone), the ranks' next
collectives on the DP group no longer pair up: they wait for each other until the process-group
timeout, or pair up wrongly and average the wrong grads, silently.

So before a grad sync's grads are used, and before an optimizer's ``step()`` issues collectives of
its own, the DP ranks compare a few counters (a row of eight ints each), and every rank raises the
same :class:`GradSyncDivergedError`, naming the ranks that differ and how. The rows travel:

* after backward, where the last bucket is a gloo all-reduce over exactly the DP ranks (DDP and
  ZeRO-1 on gloo), inside that all-reduce (``check_wait.CarriedRows``: each rank's row in its own slot
  after the bucket, so the sum is the gather); it is waited for with the bound below and its rows
  compared before any grad is published. No round trip of its own: on 2 shared cores a gather of a
  few ints costs as much CPU as a bucket's reduction;
* before a step, where the optimizer's step collectives run on groups of their own and are waited
  for through DDP (``DDP.finish_grad_sync_for_step``: ``ndweave.optim``'s parameter gathers on gloo),
  in those collectives: nothing is gathered (:meth:`SyncCounters.defer_step`); a wait that outlasts
  a slice posts the step's row as below (:meth:`SyncCounters.wait_step`), and ranks in step compare
  the step counts at the next sync;
* otherwise (before another step, before a ZeRO-2 backward, NCCL's buckets) in one ``all_gather`` on
  a gloo side group of the same ranks (``ndweave.mesh.lifecycle.side_group``, made once per DP
  group, ``check_wait.gather_rows``), so that it cannot queue behind the bucket reductions in flight
  on the DP group itself.

Ranks that diverged may wait in two different collectives (one in a bucket's all-reduce, the other in
the side group's gather), neither of which can complete: a check that has waited a quarter second
posts its row in the default store (``check_wait.RowBoard``) and reads its peers', and once every DP
rank has posted one for the same check, rows that differ raise as above. A rank whose peers never come
to the check (they left the loop, or this rank stepped once more after they did) raises it too, after
at most DDP's ``desync_timeout`` (60 s; the first step: the group's timeout), or at once when a peer has
called ``shutdown()`` or announced a failure, and announces its own (a peer in ``shutdown()`` then
names it). The counters:

* ``kind``: 1 when a grad sync finishes a backward's reductions; 2 when ``finish_grad_sync()`` is
  called with no backward since the last sync (an optimizer's ``step()``: checked every time, so a
  rank that skipped its step, or steps once more, is caught before the optimizer's own collectives
  (its grad norm, its parameter gathers) pair up with another collective of the others); 3 when a
  backward starts with ``zero_stage=2``, which reduces (and waits) inside every backward, so it agrees
  before each one; 4 when an optimizer's ``finish_grad_sync()`` finishes the sync (no
  ``finish_grad_sync_in_backward``, or a last micro-batch under ``no_sync()``);
* ``syncs``: grad syncs finished so far; ``steps``: ``finish_grad_sync()`` calls from outside
  backward (the optimizer's steps) so far;
* ``backwards``: backward passes in this sync (micro-batches, ``no_sync()`` ones included), ``local``
  those under ``no_sync()``, ``no_sync``: whether the backward about to start (kind 3) is;
* ``forwards``: forwards with grad enabled since the last sync (a skipped backward shows here);
* ``model``: a fingerprint of the wrapped parameters, so two wrappers on one DP group (pipeline
  chunks) never compare each other's counters.

Before all that, at wrap time, :func:`check_same_wrap` makes sure the DP ranks wrap the same model
with the same arguments (``ndweave.mesh.agree.agree_or_raise``): DDP's first collective broadcasts DP
rank 0's parameters, and a rank with other shapes would receive them silently cut short, or be
aborted by gloo.
"""

from __future__ import annotations

import weakref
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ndweave.ddp.check_wait import (CarriedRows, CheckUnanswered, RowBoard, bound_for, gather_rows, tell_peers,
                                    wait_bounded)
from ndweave.mesh.agree import agree_or_raise
from ndweave.mesh.lifecycle import side_group
from ndweave.mesh.torch_compat import current_backward_id

__all__ = ["ROW_WIDTH", "GradSyncDivergedError", "SyncCounters", "check_same_wrap"]

_FIELDS = ("kind", "syncs", "backwards", "forwards", "model", "steps", "local", "no_sync")
ROW_WIDTH = len(_FIELDS)
"""Ints in a rank's row (what a collective carrying the rows makes room for)."""
_AFTER_BACKWARD, _STEP, _BEFORE_BACKWARD, _STEP_SYNC = 1, 2, 3, 4
_FIX = ("Every DP rank must run the same forwards, backward()s, no_sync() blocks and optimizer steps (run forwards "
        "you do not train on under torch.no_grad()); detect_desync=False turns this check off")


class GradSyncDivergedError(RuntimeError):
    """The data-parallel ranks no longer run the same forwards, backwards and grad syncs (raised on
    every DP rank, naming the ranks that differ)."""


class SyncCounters:
    """One wrapper's counters, and their comparison across the DP ranks of ``group``.

    ``group`` ``None`` (DP size 1) or ``enabled=False``: counting only, nothing compared. ``micro``:
    the wrapper, whose ``is_last_microbatch`` tells a ``no_sync()`` backward (held weakly)."""

    def __init__(self, group: dist.ProcessGroup | None, names: Sequence[str], *, enabled: bool,
                 micro: Any = None, timeout: float = 60.0) -> None:
        self.syncs = 0
        self.backwards = 0
        self.forwards = 0
        self.steps = 0  # finish_grad_sync() calls from outside backward: the optimizer's step()s
        self.local = 0  # backward passes of this sync run under no_sync()
        self.timeout = timeout
        self._backward_id = -1
        self._micro = weakref.ref(micro) if micro is not None else (lambda: None)
        self._model = zlib.crc32("\n".join(names).encode()) & 0x7FFFFFFF
        self._check_group = side_group(group, "ddp-sync-check") if enabled and group is not None else None
        self._ranks = dist.get_process_group_ranks(group) if self._check_group is not None else []
        self.checks = 0  # checks passed: equal on ranks in step, so rows posted on the board pair by it
        self._last: tuple[int, tuple[int, ...]] = (0, ())  # the latest check's (seq, row): what a step's waits post
        self._board = RowBoard(f"{group.group_name}/{self._model}", self._ranks) if self._ranks else None

    @property
    def ranks(self) -> list[int]:
        """The DP ranks compared (global ranks, in group order); ``[]`` when nothing is compared."""
        return self._ranks

    def count_forward(self) -> None:
        if torch.is_grad_enabled():
            self.forwards += 1

    def count_backward(self) -> None:
        """Called from every grad hook: counts the backward passes they belong to."""
        if self.is_new_backward():
            self._backward_id = current_backward_id()
            self.backwards += 1
            self.local += self._in_no_sync()

    def is_new_backward(self) -> bool:
        """Whether the grad hook running belongs to a backward not counted yet."""
        return current_backward_id() != self._backward_id

    def agree_before_backward(self) -> None:
        """Before a backward that issues collectives of its own (ZeRO-2's), agree on the counts so far."""
        self._agree(_BEFORE_BACKWARD, self.syncs + 1, self.steps, no_sync=self._in_no_sync())

    def start_sync(self) -> None:
        self.backwards = 0
        self.local = 0
        self._backward_id = -1

    def sync_row(self, *, in_backward: bool) -> tuple[int, ...]:
        """The row :meth:`finish_sync` compares: for a collective to carry it (:meth:`agree_carried`)."""
        return self._row(_AFTER_BACKWARD if in_backward else _STEP_SYNC, self.syncs + 1, self.steps + (not in_backward))

    def agree_carried(self, work: dist.Work, row: tuple[int, ...], rows: CarriedRows) -> None:
        """Wait for ``work``, the all-reduce carrying every rank's ``row`` in ``rows``, bounded as a
        check's gather is, and compare the rows: the same errors as :meth:`finish_sync`'s own gather,
        without its round trip. Then call :meth:`finish_sync` with ``carried=True`` to count the sync."""
        self._last = (self.checks, row)
        self._wait(work, [rows.region])
        self._compare(rows.rows())

    def finish_sync(self, *, in_backward: bool, carried: bool = False) -> None:
        """A grad sync is about to wait for its reductions: agree (unless its last all-reduce carried the
        rows, compared already), then count it (and, finished outside backward, by an optimizer's
        ``finish_grad_sync()``, that step)."""
        if carried:
            self.checks += 1
        else:
            self._agree(_AFTER_BACKWARD if in_backward else _STEP_SYNC, self.syncs + 1, self.steps + (not in_backward))
        self.syncs += 1
        self.steps += not in_backward
        self.forwards = 0
        self.backwards = 0
        self.local = 0

    def defer_step(self) -> None:
        """:meth:`finish_without_backward` for an optimizer whose step's collectives carry the check
        (``DDP.finish_grad_sync_for_step``): count the step, gather nothing; the step's collectives
        are waited through :meth:`wait_step`, which compares this row with the peers' if they wait."""
        self.steps += 1
        if self._check_group is not None:
            self._last = (self.checks, self._row(_STEP, self.syncs, self.steps))
            self.checks += 1

    def wait_step(self, work: dist.Work, tensors: list[torch.Tensor]) -> None:
        """Wait for one of the step's collectives, bounded as a check is: peers that did not come to this
        step (they skipped it, or this rank steps once more) wait in a check of their own, whose row
        they post, and every rank raises the same error."""
        if self._check_group is None:
            work.wait()
            return
        self._wait(work, tensors)

    def _wait(self, work: dist.Work, tensors: list[torch.Tensor]) -> None:
        """Wait for ``work`` with the check's bound, posting the latest check's row on the board when slow."""
        seq, row = self._last
        try:
            wait_bounded(work, self._ranks, bound_s=self._bound(row[0]), keep=tensors,
                         on_slice=lambda: self._compare_posted(seq, row))
        except CheckUnanswered as unanswered:
            raise tell_peers(GradSyncDivergedError(_unanswered(row, self._ranks, unanswered))) from None
        # (cleared only when the wait completed: a rank that raised on the posted rows leaves its own
        # posted, for the peers that have not read it yet)
        self._board.clear()

    def finish_without_backward(self) -> None:
        """``finish_grad_sync()`` with no backward since the last sync: an optimizer's ``step()``. Agreed
        every time, before the optimizer's own collectives: a rank that skipped its step (an exception
        caught after backward) would otherwise pair them with its next backward's reductions (gloo
        aborts), and one that steps once more would wait in them."""
        self.steps += 1
        self._agree(_STEP, self.syncs, self.steps)

    def close(self) -> None:
        """Compare nothing from now on (the wrapper is closed); the side group stays, shared by the
        other wrappers on the same DP group."""
        self._check_group, self._ranks = None, []

    def _in_no_sync(self) -> int:
        micro = self._micro()
        return int(micro is not None and not micro.is_last_microbatch)

    def _row(self, kind: int, syncs: int, steps: int, *, no_sync: int = 0) -> tuple[int, ...]:
        return (kind, syncs, self.backwards, self.forwards, self._model, steps, self.local, no_sync)

    def _bound(self, kind: int) -> float:
        first = self.syncs == 0 and self.steps <= (kind == _STEP)  # the first step may keep ranks apart longer
        return bound_for(self._check_group, first, self.timeout)

    def _agree(self, kind: int, syncs: int, steps: int, *, no_sync: int = 0) -> None:
        if self._check_group is None:
            return
        row, seq = self._row(kind, syncs, steps, no_sync=no_sync), self.checks
        self._last = (seq, row)
        try:
            table = gather_rows(self._check_group, self._ranks, row, bound_s=self._bound(kind),
                                on_slice=lambda: self._compare_posted(seq, row))
        except CheckUnanswered as unanswered:
            raise tell_peers(GradSyncDivergedError(_unanswered(row, self._ranks, unanswered))) from None
        self._board.clear()
        self._compare([table[rank] for rank in self._ranks])
        self.checks += 1

    def _compare(self, rows: list[tuple[int, ...]]) -> None:
        if len(set(rows)) > 1:
            raise tell_peers(GradSyncDivergedError(_explain(rows, self._ranks)))

    def _compare_posted(self, seq: int, row: tuple[int, ...]) -> None:
        """A check that waited a slice: post this rank's row and compare those its peers posted. Peers
        waiting in another collective than this rank's (a step() against a backward's sync) raise here,
        once every DP rank has posted; peers merely late post nothing and are waited for."""
        self._board.post(seq, row)
        posted = self._board.read(seq)
        if len(posted) == len(self._ranks):
            self._compare([posted[rank] for rank in self._ranks])


def check_same_wrap(group: dist.ProcessGroup | None, fingerprint: dict[str, str]) -> None:
    """Before DDP's first collective: raise the same ``ValueError`` on every DP rank of ``group`` unless
    all hold the same ``fingerprint`` (each parameter's and buffer's shape, dtype and whether it is
    synced, in order, and the arguments that shape the buckets), naming the first entry that differs.

    One small gather of a digest (``ndweave.mesh.agree.agree_or_raise``); the fingerprints themselves
    travel only when they differ."""
    if group is None or dist.get_world_size(group) == 1:
        return
    ranks = dist.get_process_group_ranks(group)
    # as a list: entries in another order are another model (the buckets would be laid out otherwise)
    agree_or_raise(group, "DDP", lambda: (None, {"wrap": list(fingerprint.items())}),
                   mismatch=lambda everyone: _another_wrap([everyone[rank]["wrap"] for rank in ranks], ranks))


def _another_wrap(wraps: list[list[tuple[str, str]]], ranks: list[int]) -> ValueError:
    """The error naming the first DP rank whose fingerprint differs from DP rank 0's, and the entry."""
    odd = next(i for i, wrap in enumerate(wraps) if wrap != wraps[0])
    first, other = dict(wraps[0]), dict(wraps[odd])
    key = next((k for k in [*first, *other] if first.get(k) != other.get(k)), None)
    what = ("the same entries in another order" if key is None else
            f"{key}: {other.get(key, '<absent>')} there, {first.get(key, '<absent>')} on rank {ranks[0]}")
    return ValueError(
        f"DDP: rank {ranks[odd]} (DP rank {odd}) wraps another model, or passes other arguments, than rank "
        f"{ranks[0]} (DP rank 0): {what}. Every DP rank must build the same model (same config, same frozen "
        "params) and wrap it with the same arguments: DDP broadcasts DP rank 0's parameters and pairs the ranks' "
        "grad buckets one to one"
    )


def _explain(rows: list[tuple[int, ...]], ranks: list[int]) -> str:
    """Which ranks differ from the most common row, how, and what usually causes it."""
    usual = dict(zip(_FIELDS, Counter(rows).most_common(1)[0][0]))
    odd = [i for i, row in enumerate(rows) if dict(zip(_FIELDS, row)) != usual]  # (a tie: the first rank's is usual)
    others = [rank for i, rank in enumerate(ranks) if i not in odd]
    they = f"DP rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    lines = []
    for i in odd:
        row = dict(zip(_FIELDS, rows[i]))
        lines.append(f"rank {ranks[i]} (DP rank {i}) {_describe(row)}; {they} {_describe(usual)}: "
                     f"{_difference(row, usual, ranks[i], they)}")
    return "the data-parallel ranks diverged: " + "; ".join(lines) + ". " + _FIX


def _unanswered(values: tuple[int, ...], ranks: list[int], unanswered: CheckUnanswered) -> str:
    """The check found no partner: what this rank was doing, and what it knows of the others."""
    me, row = dist.get_rank(), dict(zip(_FIELDS, values))
    others = [r for r in ranks if r != me]
    head = (f"rank {me} (DP rank {ranks.index(me)}) {_describe(row)}, but DP ranks {others} did not come to the "
            f"DP ranks' check (waited {unanswered.waited_s:.1f} s)")
    what = "step()" if row["kind"] in (_STEP, _STEP_SYNC) else "backward()"
    if unanswered.failed:
        return head + ": " + "; ".join(f"rank {r} failed: {m}" for r, m in sorted(unanswered.failed.items()))
    if unanswered.left:
        return (f"{head}: ranks {unanswered.left} had already called shutdown(): rank {me} ran a {what} they did not "
                f"(an extra {what} on rank {me}, or a skipped one or a loop left early on theirs). " + _FIX)
    if unanswered.error:
        return f"{head}: they are gone, failed or exited (gloo: {unanswered.error})"
    return (f"{head}: rank {me} ran a {what} they did not (an extra {what} on rank {me}), or they skipped one, "
            f"or they wait in another collective (a step() rank {me} skipped?) or are gone. " + _FIX)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _describe(row: dict[str, int]) -> str:
    local = f" ({row['local']} under no_sync())" if row["local"] else ""
    if row["kind"] == _STEP:
        return (f"called step() a {_ordinal(row['steps'])} time, with {row['forwards']} forward(s) and no backward "
                f"since grad sync #{row['syncs']}")
    if row["kind"] == _STEP_SYNC:
        return (f"called step() a {_ordinal(row['steps'])} time, finishing grad sync #{row['syncs']} after "
                f"{row['backwards']} backward pass(es){local} and {row['forwards']} forward(s)")
    if row["kind"] == _BEFORE_BACKWARD:
        return (f"starts backward pass {row['backwards'] + 1}{' under no_sync()' if row['no_sync'] else ''} of grad "
                f"sync #{row['syncs']} after {row['forwards']} forward(s), {row['steps']} step()s so far")
    return (f"finishes grad sync #{row['syncs']} after {row['backwards']} backward pass(es){local} and "
            f"{row['forwards']} forward(s), {row['steps']} step()s so far")


def _difference(row: dict[str, int], ref: dict[str, int], rank: int, they: str) -> str:
    """What the odd rank did that the others did not, as far as the rows tell."""
    if row["model"] != ref["model"]:
        return "it checks another model's grad sync (wrappers created in another order?)"
    if _pending(row) != _pending(ref):
        who = f"rank {rank}" if _pending(row) > _pending(ref) else they
        return f"{who} skipped a backward() (a forward with grad whose backward never ran)"
    if row["no_sync"] != ref["no_sync"]:
        entered = (f"rank {rank}", they) if row["no_sync"] else (they, f"rank {rank}")
        return (f"{entered[0]} entered no_sync() for this backward, {entered[1]} did not: enter it on every rank "
                "or on none")
    if row["local"] != ref["local"]:
        return (f"rank {rank} entered no_sync() for {row['local']} backward(s) of this grad sync, {they} for "
                f"{ref['local']}: enter it on every rank or on none")
    if _surplus(row) > _surplus(ref):
        return f"rank {rank} called step() once more than {they}, or skipped a backward() they ran"
    if _surplus(row) < _surplus(ref):
        return (f"rank {rank} skipped a step() {they} called (an exception caught and the loop gone on, or a step "
                f"skipped on rank {rank}), or {they} called one more")
    if row["kind"] != ref["kind"] or row["syncs"] != ref["syncs"]:
        return f"rank {rank} skipped a backward() {they} ran, or ran one more"
    return (f"{row['backwards']} backward pass(es) in this sync against {ref['backwards']}: no_sync() or "
            "set_is_last_microbatch() on some ranks only?")


def _pending(row: dict[str, int]) -> int:
    """Forwards with grad whose backward has not run (the one a kind-3 check is about to run excepted)."""
    return row["forwards"] - row["backwards"] - (row["kind"] == _BEFORE_BACKWARD)


def _surplus(row: dict[str, int]) -> int:
    """Steps beyond the grad syncs done (one being finished in backward is not done yet): equal on ranks in step."""
    return row["steps"] - (row["syncs"] - (row["kind"] in (_AFTER_BACKWARD, _BEFORE_BACKWARD)))
