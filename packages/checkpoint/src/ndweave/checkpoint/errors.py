"""The errors a save or load raises: ordinary ``Exception``s (torch's ``CheckpointException``
derives from ``BaseException``, which ``except Exception`` does not catch), each naming what is
wrong: the ranks that failed, the files that are missing or damaged, the keys that do not match."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CheckpointError", "CheckpointMismatchError", "CorruptCheckpointError"]


class CheckpointError(RuntimeError):
    """A save or load failed; the message names the ranks and what each reported."""


class CorruptCheckpointError(CheckpointError):
    """Files of a checkpoint are missing, truncated or unreadable: :attr:`files` names them."""

    def __init__(self, path: str, problems: Sequence[str], files: Sequence[str]) -> None:
        self.path, self.problems, self.files = path, list(problems), list(files)
        super().__init__(f"checkpoint {path} is damaged ({len(problems)} "
                         f"problem{'s' if len(problems) != 1 else ''}):\n  " + "\n  ".join(problems))

    def __reduce__(self):  # DCP sends a rank's error to the others pickled
        return type(self), (self.path, self.problems, self.files)


class CheckpointMismatchError(CheckpointError):
    """The checkpoint and the state loaded into differ in keys or global shapes. Each list holds one
    line per problem; ``load(..., strict=False)`` loads what matches and returns them instead."""

    def __init__(self, path: str, missing: Sequence[str], unexpected: Sequence[str], mismatched: Sequence[str]) -> None:
        self.path = path
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        parts = [f"checkpoint {path} does not match the state it is loaded into"]
        for title, lines in (("missing from the checkpoint", self.missing),
                             ("in the checkpoint, not in the state", self.unexpected),
                             ("different global shape or kind", self.mismatched)):
            if lines:
                parts.append(f"{title} ({len(lines)}):\n  " + "\n  ".join(lines))
        parts.append("(load(..., strict=False) loads what matches and returns these lists)")
        super().__init__("\n".join(parts))

    def __reduce__(self):
        return type(self), (self.path, self.missing, self.unexpected, self.mismatched)
