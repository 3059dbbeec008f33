"""Where every step's metrics go: one :class:`Sink` protocol, three sinks (rank 0 only).

* :class:`ProgressBar`: the console, a tqdm bar with the step's loss, tokens/s and MFU;
* :class:`JsonlFile`: a JSON line per step (``--metrics``; a resumed run goes on appending);
* :class:`TensorBoard`: event files (``--tensorboard``, when the tensorboard package is installed).

    sinks = Sinks([ProgressBar(start, last), JsonlFile("m.jsonl")])
    sinks.write(step_row(step=1, loss=5.5, val_loss=math.nan, lr=1e-3, grad_norm=0.9, seconds=0.1, tokens=1024,
                         peak_bytes=2**20))
    sinks.close()
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol

from tqdm import tqdm

__all__ = ["JsonlFile", "ProgressBar", "Sink", "Sinks", "TensorBoard", "open_sinks", "say", "step_row"]


class Sink(Protocol):
    """Takes every step's row (:func:`step_row`) as the step ends."""

    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def step_row(*, step: int, loss: float, val_loss: float, lr: float, grad_norm: float | None, seconds: float,
             tokens: int, peak_bytes: int, mfu: float | None = None, data_seconds: float = 0.0) -> dict[str, Any]:
    """One step's metrics as every sink takes them: NaN (no validation this step) as None, ``mfu`` only
    where it is known; ``data_s`` the part of ``step_s`` rank 0 spent reading its batch."""
    return {"step": step, "loss": loss, "val_loss": None if math.isnan(val_loss) else val_loss, "lr": lr,
            "grad_norm": grad_norm, "tokens_s": tokens / max(seconds, 1e-9), "step_s": seconds,
            "data_s": data_seconds, "peak_bytes": peak_bytes, **({} if mfu is None else {"mfu": mfu})}


def say(text: str) -> None:
    """A line on the console that leaves the progress bar where it is."""
    tqdm.write(text)


class ProgressBar:
    """The console: a bar from step ``start`` to ``last``, the step's loss, validation loss, tokens/s,
    MFU and milliseconds beside it."""

    def __init__(self, start: int, last: int) -> None:
        self.bar = tqdm(total=last, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def write(self, row: dict[str, Any]) -> None:
        shown = {"loss": f"{row['loss']:.4f}", **({} if row["val_loss"] is None else {"val": f"{row['val_loss']:.4f}"}),
                 "tok_s": f"{row['tokens_s']:,.0f}", **({"mfu": f"{row['mfu']:.1%}"} if "mfu" in row else {}),
                 "step_ms": f"{row['step_s'] * 1e3:.0f}"}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class JsonlFile:
    """A JSON line per step, appended to ``path`` (a resumed run goes on appending)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        pass


class TensorBoard:
    """TensorBoard event files in ``folder`` (``torch.utils.tensorboard``: the tensorboard package is
    optional; ``config.check`` refuses ``--tensorboard`` without it): a scalar per metric but the step."""

    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.board = SummaryWriter(folder)

    def write(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if key != "step" and value is not None:
                self.board.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.board.close()


class Sinks:
    """Several sinks as one."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def write(self, row: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(metrics: Any, start: int, last: int, rank: int) -> Sinks:
    """The sinks ``metrics`` (a :class:`~ndweave_gpt.config.MetricsConfig`) asks for on this rank: every
    sink on rank 0 (the bar unless ``--quiet``), none elsewhere."""
    if rank != 0:
        return Sinks([])
    sinks: list[Sink] = [] if metrics.quiet else [ProgressBar(start, last)]
    if metrics.jsonl:
        sinks.append(JsonlFile(metrics.jsonl))
    if metrics.tensorboard:
        sinks.append(TensorBoard(metrics.tensorboard))
    return Sinks(sinks)
