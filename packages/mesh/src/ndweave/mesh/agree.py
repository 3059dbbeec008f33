"""Agree, or raise on every rank: the one way ndweave turns a mistake seen by some ranks into the same
error on all of them, before any of them waits in a collective.

A user mistake seen by one rank only (a plan that differs by rank, a model built from another config,
a state dict that does not fit) would otherwise make that rank raise while the others block in the
next collective until the process-group timeout. So each rank checks locally (no communication), then
the ranks exchange a small payload (a digest of what must be equal, a few local values, or the error
they hit) and every rank reaches the same verdict:

* :func:`agree_or_raise`: every rank's check passed and the ranks hold equal fingerprints, or every
  rank raises the first failed rank's error (its type, that rank named), or a
  :class:`RankMismatchError` naming the entry that differs and the ranks on each side;
* :func:`raise_on_every_rank`: every rank's list of problems, raised together on all ranks.

Both take ``over``: a ``DeviceMesh`` (all its ranks; an nD mesh has no single process group, so the
exchange runs dim by dim on its dims' groups), a process group, or ``None`` for the default group.
Outside a process group they are local calls. Ranks are named by their global rank.

    from ndweave.mesh.agree import agree_or_raise
    plan, _ = agree_or_raise(mesh, "parallelize_module", lambda: (plan, {"plan": repr(plan)}))

The exchanges under them, for protocols of a package's own: :func:`gather` (every rank's value on
every rank), :func:`gather_ints` (the same for a few ints, one tensor collective: per-step checks) and
:func:`decide_on_first` (values gathered on the first rank, which decides each rank's answer:
DCP's planning pattern, where no rank may receive every other's value).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Over", "RankMismatchError", "agree_or_raise", "decide_on_first", "gather", "gather_ints",
           "raise_on_every_rank"]

T = TypeVar("T")

#: Who agrees: every rank of a mesh, of a process group, or of the default group (``None``).
Over = Union[DeviceMesh, dist.ProcessGroup, None]


class RankMismatchError(ValueError):
    """Ranks disagree on what they were given (a plan, a model, a shape); raised on every rank."""


def gather(over: Over, value: Any) -> dict[int, Any]:
    """Every rank's ``value`` by global rank, on every rank of ``over`` (a collective: call it on all).

    A mesh: one ``all_gather_object`` per mesh dim on that dim's group; after dim d a rank holds the
    values of every rank that differs from it only in dims 0..d, so after the last it holds all."""
    if not dist.is_available() or not dist.is_initialized():
        return {0: value}
    table = {dist.get_rank(): value}
    if dist.get_backend() == "fake":  # one process pretending (``fake_world``): no other rank's value exists
        return table
    for group in _groups(over):
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, table, group=group)
        table = {rank: v for part in parts for rank, v in part.items()}
    return table


def gather_ints(over: Over, values: Sequence[int], *,
                device: torch.device | str = "cpu") -> dict[int, tuple[int, ...]]:
    """Every rank's ``values`` (as many ints on every rank) by global rank, on every rank of ``over``:
    :func:`gather` for checks that run every step, one ``all_gather`` of an int64 tensor on ``device``
    (where ``over`` communicates: ``"cpu"`` for gloo) per group, nothing pickled::

        counts = gather_ints(check_group, [syncs, backwards, forwards])   # {0: (3, 1, 1), 1: (3, 1, 1)}

    Errors of the collective (a timeout: a peer that never came) propagate to the caller."""
    if not dist.is_available() or not dist.is_initialized():
        return {0: tuple(int(v) for v in values)}
    if dist.get_backend() == "fake":
        return {dist.get_rank(): tuple(int(v) for v in values)}
    table = torch.tensor([[dist.get_rank(), *values]], dtype=torch.int64, device=device)  # a row per rank
    for group in _groups(over):
        parts = [torch.empty_like(table) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, table, group=group)
        table = torch.cat(parts)
    return {row[0]: tuple(row[1:]) for row in table.tolist()}


def decide_on_first(over: dist.ProcessGroup | None, what: str, value: Any,
                    decide: Callable[[dict[int, Any]], Mapping[int, Any]]) -> Any:
    """Every rank's ``value`` gathered on the first rank of ``over`` (a process group, ``None``: the
    default one), where ``decide(values by global rank)`` returns each rank's answer by global rank;
    each rank gets its own answer back (a collective: call it on all). No rank but the first receives
    the others' values (DCP's planning pattern: plans meet on the coordinator only). Two collectives;
    a local call without a process group.

    A rank whose part failed sends that instead of its value, and ``decide`` turns it into every
    rank's answer (that is the caller's protocol); if ``decide`` itself raises, every rank raises its
    error (rebuilt from its type and message, the first rank named)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend() == "fake":
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return decide({me: value})[me]
    ranks = dist.get_process_group_ranks(over if over is not None else dist.group.WORLD)
    first, me = ranks[0], dist.get_rank()
    gathered: list[Any] | None = [None] * len(ranks) if me == first else None
    dist.gather_object(value, gathered, group=over, group_dst=0)
    own: Exception | None = None
    replies: list[Any] | None = None
    if me == first:
        try:
            answers = decide(dict(zip(ranks, gathered)))
            replies = [("ok", answers[rank]) for rank in ranks]
        except Exception as error:  # noqa: BLE001 - sent to every rank, raised there
            own, replies = error, [("error", type(error), str(error))] * len(ranks)
    received: list[Any] = [None]
    dist.scatter_object_list(received, replies, group=over, group_src=0)
    reply = received[0]
    if reply[0] == "error":
        raise _rebuild(reply[1], f"{what} failed on rank {first}: {reply[2]}") from own
    return reply[1]


def agree_or_raise(over: Over, what: str, check: Callable[[], tuple[T, Mapping[str, Any]]], *,
                   hint: str = "", mismatch: Callable[[dict[int, dict[str, Any]]], Exception] | None = None,
                   ) -> tuple[T, dict[int, Any]]:
    """Run ``check()`` (local checks, no collectives) on every rank of ``over`` and agree on the outcome.

    ``check`` returns ``(result, fingerprint)``: a small dict of picklable values every rank must hold
    equal (e.g. ``{"plan": ..., "shapes": ...}``), plus an entry ``"local"`` that may differ (gathered,
    not compared). Returns this rank's ``result`` and every rank's ``fingerprint["local"]`` by global
    rank. If any rank raised, every rank raises that error (rebuilt from its type and message, the rank
    named, chained to this rank's own error if it had one); if fingerprints differ, every rank raises
    :class:`RankMismatchError` naming the first entry that differs and the ranks on each side, then
    ``hint`` (the fix; default: pass every rank the same); or, given ``mismatch``, the error it builds
    from every rank's fingerprint (by global rank; ``"local"`` left out) where a caller phrases it its
    own way. One small gather when all is well (a digest travels, not the fingerprint); a second only
    when the fingerprints differ.
    """
    if isinstance(over, DeviceMesh) and over.get_coordinate() is None:  # not in the mesh: no one to agree with
        return check()[0], {}
    own: Exception | None = None
    try:
        result, fingerprint = check()
        shared = {k: v for k, v in fingerprint.items() if k != "local"}
        payload: Any = ("ok", hashlib.sha256(repr(shared).encode()).hexdigest(), fingerprint.get("local"))
    except Exception as error:  # noqa: BLE001 - sent to every rank, raised there
        result, payload, own = None, ("error", type(error), str(error)), error
    everyone = gather(over, payload)
    failed = sorted(rank for rank, p in everyone.items() if p[0] == "error")
    if failed:
        _, cls, message = everyone[failed[0]]
        others = f" (and ranks {failed[1:]})" if len(failed) > 1 else ""
        raise _rebuild(cls, f"{what} failed on rank {failed[0]}{others}: {message}") from own
    if len({p[1] for p in everyone.values()}) > 1:  # every rank sees this, so every rank gathers again
        fingerprints = gather(over, shared)
        if mismatch is not None:
            raise mismatch(fingerprints)
        _raise_first_difference(what, fingerprints, hint)
    return result, {rank: p[2] for rank, p in everyone.items()}


def raise_on_every_rank(over: Over, what: str, problems: list[str], error: type[Exception] = RankMismatchError,
                        fix: str = "") -> None:
    """Gather every rank's ``problems`` (strings) and, if any rank has one, raise ``error`` on every
    rank listing each problem with the ranks that found it, then ``fix`` (a collective: call it on all)."""
    ranks_of: dict[str, list[int]] = {}
    for rank, found in sorted(gather(over, problems).items()):
        for problem in found:
            ranks_of.setdefault(problem, []).append(rank)
    if ranks_of:
        lines = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {p}" for p, r in ranks_of.items()]
        raise error(f"{what}:\n  " + "\n  ".join(lines) + (f"\n{fix}" if fix else ""))


def _groups(over: Over) -> list[dist.ProcessGroup | None]:
    """The groups an exchange over ``over`` runs on, one after the other (those of more than one rank)."""
    if isinstance(over, DeviceMesh):
        return [over.get_group(d) for d in range(over.ndim) if over.size(d) > 1]
    return [over] if dist.get_world_size(over) > 1 else []


def _raise_first_difference(what: str, fingerprints: dict[int, dict[str, Any]], hint: str) -> None:
    (first_rank, first), *others = sorted(fingerprints.items())
    for rank, other in others:
        for key in [*first, *(k for k in other if k not in first)]:
            if other.get(key, "<absent>") != first.get(key, "<absent>"):
                raise RankMismatchError(
                    f"{what}: rank {rank} was given another {key} than rank {first_rank}: "
                    f"{_difference(first.get(key, '<absent>'), other.get(key, '<absent>'), first_rank, rank)}; "
                    + (hint or f"every rank must pass the same {key} (a rank-dependent value, e.g. a config "
                               "read per rank?)"))
    # equal values whose reprs differ (a dict built in another order): they agree


def _difference(a: Any, b: Any, rank_a: int, rank_b: int) -> str:
    """The first differing entry of two fingerprint values (dicts: by key), for the message."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                return f"{key!r} is {a.get(key, '<absent>')} on rank {rank_a} but {b.get(key, '<absent>')} on rank {rank_b}"
    return f"{a} on rank {rank_a}, {b} on rank {rank_b}"


def _rebuild(cls: type, message: str) -> Exception:
    """The error a rank raised, rebuilt from its type and message (every rank raises this)."""
    try:
        error = cls(message)
        if isinstance(error, Exception) and str(error) == message:
            return error
    except Exception:  # noqa: BLE001 - a type that takes other arguments: fall back below
        pass
    return RuntimeError(f"{cls.__name__}: {message}")
