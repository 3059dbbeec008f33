"""A checkpoint directory appears whole or not at all.

Every rank writes into ``.<name>.partial-<save id>`` next to the final path, then reports to a status
folder inside it: ``rank<r>.ok`` (its write results, which the metadata needs) or ``rank<r>.err``.
Rank 0 waits for every report, writes DCP's ``.metadata`` and the completion marker
(:data:`MARKER`: the save id and every file's size), and renames the folder into place: one atomic
rename. Any failure, or a rank that never reports within the timeout, makes rank 0 write ``abort``
instead, and the others raise on reading it. A crash or kill at any point leaves a ``.partial``
folder that nothing loads; the previous checkpoint is untouched.

Coordination goes through files, not collectives, so that an asynchronous save's background thread
never issues a collective beside the training loop's on the same process group (the ranks must share
the file system, as DCP's loading already requires).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ndweave.checkpoint.errors import CheckpointError, CorruptCheckpointError

__all__ = ["MARKER", "SaveCommit", "check_files", "is_complete", "is_partial", "read_marker"]

#: The completion marker in every committed checkpoint folder (JSON: save id, world size, file sizes).
MARKER = ".ndweave-complete"
_STATUS = ".ndweave-status"
_PARTIAL = ".partial-"


def is_partial(name: str) -> bool:
    """Whether a folder name is an uncommitted save's (``.<name>.partial-<id>``)."""
    return name.startswith(".") and _PARTIAL in name


def read_marker(path: str | os.PathLike) -> dict[str, Any] | None:
    """The completion marker of the checkpoint at ``path``, or ``None`` if it has none."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a committed ndweave checkpoint (its marker is there)."""
    return read_marker(path) is not None


def _write_atomic(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write ``data`` under a temporary name and rename it: readers see all of it or nothing.
    ``durable``: fsync first (the marker); the status reports only need to be seen by the other
    ranks, not to survive a power cut."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _poll(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """``check()``'s first truthy answer, polling with a growing interval; ``CheckpointError``
    naming ``what()`` once ``timeout`` seconds pass."""
    deadline, interval = time.monotonic() + timeout, 0.001
    while True:
        answer = check()
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out after {timeout:.0f} s waiting for {what()}")
        time.sleep(interval)
        interval = min(interval * 2, 0.01)  # a stat() is cheap; a late wake-up delays the save


class SaveCommit:
    """One save's folder protocol (module docstring), from the point of view of rank ``rank``."""

    def __init__(self, path: str | os.PathLike, save_id: str, rank: int, world_size: int, timeout: float) -> None:
        self.path = Path(path)
        self.save_id, self.rank, self.world_size, self.timeout = save_id, rank, world_size, timeout
        self.staging = self.path.parent / f".{self.path.name}{_PARTIAL}{save_id}"
        self._status = self.staging / _STATUS

    def prepare(self) -> None:
        self._status.mkdir(parents=True, exist_ok=True)

    def report_done(self, results: Any) -> None:
        _write_atomic(self._status / f"rank{self.rank}.ok", pickle.dumps(results))

    def report_failed(self, text: str) -> None:
        """Tell rank 0 this rank failed (rank 0 aborts at once)."""
        try:
            self.prepare()
            _write_atomic(self._status / f"rank{self.rank}.err", text.encode())
            if self.rank == 0:
                self._abort(f"rank 0 failed:\n{text}")
        except OSError:
            pass  # the folder itself is unwritable: the others time out, and the save was never committed

    def _abort(self, message: str) -> None:
        _write_atomic(self._status / "abort", message.encode())

    def collect(self) -> list[Any]:
        """Rank 0: every rank's reported results, in rank order; aborts on any failure."""
        def reports():
            ok = [self._status / f"rank{r}.ok" for r in range(self.world_size)]
            errors = {r: p for r in range(self.world_size) if (p := self._status / f"rank{r}.err").exists()}
            if errors:
                return ("err", errors)
            return ("ok", ok) if all(p.exists() for p in ok) else None

        def missing() -> str:
            late = [r for r in range(self.world_size) if not (self._status / f"rank{r}.ok").exists()]
            return f"ranks {late} to finish writing {self.path} (did they die?)"

        try:
            kind, found = _poll(reports, self.timeout, missing)
        except CheckpointError as error:
            self._abort(str(error))
            raise
        if kind == "err":
            message = "\n".join(f"----- rank {r} -----\n{p.read_text()}" for r, p in found.items())
            message = f"saving {self.path} failed on ranks {sorted(found)}; nothing was committed\n{message}"
            self._abort(message)
            raise CheckpointError(message)
        return [pickle.loads(p.read_bytes()) for p in found]

    def commit(self, write_metadata: Callable[[], None]) -> None:
        """Rank 0: write the metadata and the marker, move the folder into place."""
        try:
            write_metadata()
            shutil.rmtree(self._status)
            files = {p.name: p.stat().st_size for p in sorted(self.staging.iterdir()) if p.is_file()}
            marker = {"format": "ndweave-checkpoint", "version": 1, "save_id": self.save_id,
                      "world_size": self.world_size, "time": time.time(), "files": files}
            _write_atomic(self.staging / MARKER, json.dumps(marker, indent=1).encode(), durable=True)
            _fsync_dir(self.staging)
            replaced = self.path.parent / f".{self.path.name}.replaced-{self.save_id}"
            if self.path.exists():
                os.rename(self.path, replaced)
            os.rename(self.staging, self.path)
            _fsync_dir(self.path.parent)
            shutil.rmtree(replaced, ignore_errors=True)
        except Exception as error:
            if self.staging.exists():
                self.prepare()
                self._abort(f"rank 0 could not commit {self.path}: {error!r}")
            raise

    def wait_committed(self) -> None:
        """Ranks other than 0: return once rank 0 committed this save; raise if it aborted."""
        def outcome():
            marker = read_marker(self.path)
            if marker is not None and marker.get("save_id") == self.save_id:
                return "committed"
            abort = self._status / "abort"
            return abort.read_text() if abort.exists() else None

        answer = _poll(outcome, self.timeout, lambda: f"rank 0 to commit {self.path}")
        if answer != "committed":
            raise CheckpointError(answer)


def check_files(path: str | os.PathLike, metadata: Any = None) -> None:
    """:class:`CorruptCheckpointError` naming every missing or wrongly sized file of the checkpoint
    at ``path``: sizes from the marker where there is one (an ndweave checkpoint), else at least the
    extent DCP's metadata records (a plain DCP checkpoint)."""
    path = Path(path)
    marker = read_marker(path)
    if marker is not None:
        expected = {name: ("==", size) for name, size in marker["files"].items()}
    elif metadata is None:
        raise ValueError(f"{path} has no completion marker: pass its DCP metadata to check its files")
    else:
        expected = {}
        for info in (metadata.storage_data or {}).values():
            end = info.offset + info.length
            expected[info.relative_path] = (">=", max(end, expected.get(info.relative_path, (">=", 0))[1]))
    problems, files = [], []
    for name, (how, size) in sorted(expected.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
        elif (actual := file.stat().st_size) != size and (how == "==" or actual < size):
            problems.append(f"{name}: {actual} bytes, expected {'' if how == '==' else 'at least '}{size}")
        else:
            continue
        files.append(name)
    if problems:
        raise CorruptCheckpointError(str(path), problems, files)
