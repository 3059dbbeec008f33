"""Fault injection for the GPT job's elastic tests: one rank SIGKILLs itself, on torchrun's first
attempt only (``TORCHELASTIC_RESTART_COUNT=0``), so the restarted job runs through.

``--kill-rank R --kill-at-step S``: rank R dies as step S begins (steps up to S-1 are trained, and
checkpointed if a checkpoint fell on them). With ``--kill-in-save`` it dies inside step S's
checkpoint save instead (S must be a checkpoint step): the other ranks are saving, the step's
checkpoint never completes, and the restart must take the one before.
"""

from __future__ import annotations

import os
import signal
import sys

from ndweave.mesh.elastic import restart_count
from ndweave_gpt.config import FaultConfig

__all__ = ["FaultInjection"]


class FaultInjection:
    """Put it in the checkpointed state when ``--kill-rank`` is given (its ``state_dict`` is called
    inside every save, on every rank, and holds nothing); call :meth:`before_step` at the top of
    each step."""

    def __init__(self, faults: FaultConfig, rank: int) -> None:
        armed = faults.kill_rank == rank and restart_count() == 0
        self.step = faults.kill_at_step if armed else None
        self.in_save = faults.kill_in_save
        self.current = 0

    def before_step(self, step: int) -> None:
        self.current = step
        if step == self.step and not self.in_save:
            self._kill("as it begins")

    def state_dict(self) -> dict:
        if self.current == self.step and self.in_save:
            self._kill("inside its checkpoint save")
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def _kill(self, when: str) -> None:
        print(f"fault injection: rank {os.environ.get('RANK')} SIGKILLs itself at step {self.step} {when}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
