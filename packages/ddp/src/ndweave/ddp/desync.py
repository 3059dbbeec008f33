"""Catching data-parallel ranks that stopped doing the same thing, before they wait on each other.

Every DP rank must run the same forwards, backwards and grad syncs. When one does not (it skipped a
``backward()``, called ``step()`` once more, entered ``no_sync()`` alone), the ranks' next
collectives on the DP group no longer pair up: they wait for each other until the process-group
timeout, or pair up wrongly and average the wrong grads, silently.

So before a grad sync waits on anything, the DP ranks compare a few counters (one ``all_gather`` of
five ints, ``ndweave.mesh.agree.gather_ints``). It runs on a gloo side group of the same ranks
(``ndweave.mesh.lifecycle.side_group``, made once per DP group, with its timeout), so that it cannot
queue behind the bucket reductions in flight on the DP group itself; every rank raises the same
:class:`GradSyncDivergedError`, naming the ranks that differ and how. A rank whose peers never come
to the check (they left the loop, or this rank stepped once more after they did) raises it too once
the group's timeout has passed, naming the peers that had called ``shutdown()``. The counters:

* ``kind``: 1 when a grad sync finishes a backward's reductions; 2 when ``finish_grad_sync()`` is
  called again with no backward since (an optimizer's ``step()``). The first such call after a sync
  finished in backward is the usual optimizer call and is not checked; any other is, so an extra
  ``step()`` is caught before the optimizer's own collectives (its grad norm, its parameter
  gathers) could pair up with another collective of the others; 3 when a backward starts with
  ``zero_stage=2``, which reduces (and waits) inside every backward, so it agrees before each one;
* ``syncs``: grad syncs finished so far;
* ``backwards``: backward passes in this sync (micro-batches, ``no_sync()`` ones included);
* ``forwards``: forwards with grad enabled since the last sync (a skipped backward shows here);
* ``model``: a fingerprint of the wrapped parameters, so two wrappers on one DP group (pipeline
  chunks) never compare each other's counters.

Before all that, at wrap time, :func:`check_same_wrap` makes sure the DP ranks wrap the same model
with the same arguments (``ndweave.mesh.agree.agree_or_raise``): DDP's first collective broadcasts DP
rank 0's parameters, and a rank with other shapes would receive them silently cut short, or be
aborted by gloo.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ndweave.mesh.agree import agree_or_raise, gather_ints
from ndweave.mesh.lifecycle import ranks_in_shutdown, side_group
from ndweave.mesh.torch_compat import current_backward_id, group_timeout

__all__ = ["GradSyncDivergedError", "SyncCounters", "check_same_wrap"]

_FIELDS = ("kind", "syncs", "backwards", "forwards", "model")
_AFTER_BACKWARD, _WITHOUT_BACKWARD, _BEFORE_BACKWARD = 1, 2, 3


class GradSyncDivergedError(RuntimeError):
    """The data-parallel ranks no longer run the same forwards, backwards and grad syncs (raised on
    every DP rank, naming the ranks that differ)."""


class SyncCounters:
    """One wrapper's counters, and their comparison across the DP ranks of ``group``.

    ``group`` ``None`` (DP size 1) or ``enabled=False``: counting only, nothing compared."""

    def __init__(self, group: dist.ProcessGroup | None, names: Sequence[str], *, enabled: bool) -> None:
        self.syncs = 0
        self.backwards = 0
        self.forwards = 0
        self._backward_id = -1
        self._idle_finishes = 0  # finish_grad_sync() calls with no backward since the last sync
        self._model = zlib.crc32("\n".join(names).encode()) & 0x7FFFFFFF
        self._check_group = side_group(group, "ddp-sync-check") if enabled and group is not None else None
        self._ranks = dist.get_process_group_ranks(group) if self._check_group is not None else []

    def count_forward(self) -> None:
        if torch.is_grad_enabled():
            self.forwards += 1

    def count_backward(self) -> None:
        """Called from every grad hook: counts the backward passes they belong to."""
        if self.is_new_backward():
            self._backward_id = current_backward_id()
            self.backwards += 1

    def is_new_backward(self) -> bool:
        """Whether the grad hook running belongs to a backward not counted yet."""
        return current_backward_id() != self._backward_id

    def agree_before_backward(self) -> None:
        """Before a backward that issues collectives of its own (ZeRO-2's), agree on the counts so far."""
        self._agree(_BEFORE_BACKWARD, self.syncs + 1)

    def start_sync(self) -> None:
        self.backwards = 0
        self._backward_id = -1

    def finish_sync(self, *, in_backward: bool) -> None:
        """A grad sync is about to wait for its reductions: agree, then count it. Finished outside
        backward (an optimizer's ``finish_grad_sync()``), it counts as that step's usual call."""
        self._agree(_AFTER_BACKWARD, self.syncs + 1)
        self.syncs += 1
        self.forwards = 0
        self.backwards = 0
        self._idle_finishes = 0 if in_backward else 1

    def finish_without_backward(self) -> None:
        """``finish_grad_sync()`` with no backward since the last sync: the first such call after a sync
        finished in backward is the usual optimizer one; any other may be a rank stepping alone, so agree."""
        self._idle_finishes += 1
        if self._idle_finishes > 1 or self.syncs == 0:
            self._agree(_WITHOUT_BACKWARD, self.syncs)

    def close(self) -> None:
        """Compare nothing from now on (the wrapper is closed); the side group stays, shared by the
        other wrappers on the same DP group."""
        self._check_group, self._ranks = None, []

    def _agree(self, kind: int, syncs: int) -> None:
        if self._check_group is None:
            return
        try:
            table = gather_ints(self._check_group, [kind, syncs, self.backwards, self.forwards, self._model])
        except RuntimeError as error:  # gloo's timeout (or a closed connection): the others never came
            raise GradSyncDivergedError(_unanswered(kind, self._ranks, group_timeout(self._check_group))) from error
        rows = [table[rank] for rank in self._ranks]
        if len(set(rows)) > 1:
            raise GradSyncDivergedError(_explain(rows, self._ranks))


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
    usual = Counter(rows).most_common(1)[0][0]
    odd = [i for i, row in enumerate(rows) if row != usual]  # (a tie: the first rank's row is the usual one)
    lines = []
    for i in odd:
        row = dict(zip(_FIELDS, rows[i]))
        ref = dict(zip(_FIELDS, usual))
        lines.append(f"rank {ranks[i]} (DP rank {i}): " + _difference(row, ref))
    return (
        "the data-parallel ranks diverged before a grad sync; "
        + "; ".join(lines)
        + f" (the other DP ranks of {ranks}: {_describe(dict(zip(_FIELDS, usual)))}). Every DP rank must run the "
        "same forwards, backward()s, no_sync() blocks and optimizer steps. Run forwards you do not train on "
        "under torch.no_grad(); detect_desync=False turns this check off"
    )


def _unanswered(kind: int, ranks: list[int], timeout) -> str:
    """The check found no partner: say who had left (called ``shutdown()``) where the store knows."""
    me = dist.get_rank()
    what = "a step() with no backward since the last grad sync" if kind == _WITHOUT_BACKWARD else "a grad sync"
    others = [r for r in ranks if r != me]
    head = f"rank {me} waited {timeout} at the DP ranks' check before {what}; DP ranks {others} never came"
    gone = ranks_in_shutdown(others)
    if gone:
        return (f"{head}: ranks {gone} had already called shutdown(). Rank {me} ran {what} they did not: an extra "
                "step() or backward() on this rank, or on theirs a no_sync() block, a skipped backward() or a loop "
                "left early. Every DP rank must run the same forwards, backward()s, no_sync() blocks and steps")
    return (f"{head}: either rank {me} ran {what} they did not (an extra step() or backward(), or they skipped "
            "one, used no_sync() or left the loop), or they are stuck in another collective or gone")


def _describe(row: dict[str, int]) -> str:
    if row["kind"] == _WITHOUT_BACKWARD:
        return f"a step() with no backward since grad sync #{row['syncs']}"
    if row["kind"] == _BEFORE_BACKWARD:
        return (f"backward pass {row['backwards'] + 1} of grad sync #{row['syncs']} after {row['forwards']} "
                "forward(s)")
    return (f"grad sync #{row['syncs']} after {row['backwards']} backward pass(es) and {row['forwards']} "
            "forward(s)")


def _difference(row: dict[str, int], ref: dict[str, int]) -> str:
    if row["model"] != ref["model"]:
        return "checks another model's grad sync (wrappers created in another order?)"
    if row["kind"] != ref["kind"]:
        if row["kind"] == _WITHOUT_BACKWARD:
            return (f"{_describe(row)}: it skipped a backward() or called step() once more than the others")
        if ref["kind"] == _WITHOUT_BACKWARD:
            return f"{_describe(row)}, while the others called step() without a backward (they skipped it)"
        return f"{_describe(row)}, while the others are at {_describe(ref)}: a skipped or extra backward()"
    if row["syncs"] != ref["syncs"]:
        return f"{_describe(row)}: it ran {'more' if row['syncs'] > ref['syncs'] else 'fewer'} grad syncs"
    if row["forwards"] != ref["forwards"]:
        return (f"{row['forwards']} forward(s) with grad since the last sync against {ref['forwards']}: a forward "
                "without backward (a skipped backward()?)")
    return (f"{row['backwards']} backward pass(es) in this sync against {ref['backwards']}: no_sync() or "
            "set_is_last_microbatch() on some ranks only?")
