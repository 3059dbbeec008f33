"""Each stage's time and memory in a step, side by side, so an unbalanced split shows.

With ``engine.recorder.enabled = True`` a step also weighs, per stage, what autograd keeps for the
backward (every tensor a forward saves, counted once per storage, parameters left out) and the
bytes the stage hands to the next (a DTensor's local shard: what a P2P send carries);
``engine.stage_report()`` gathers that, the actions' times and each stage's parameter bytes from
every PP rank::

    engine.recorder.enabled = True
    engine(x, y)
    report = engine.stage_report()     # on every PP rank (a collective)
    print(report.text())
    report.imbalance                   # the slowest stage's time over the mean: 1.0 is balanced

The peak is the most bytes the stage's micro-batches held at once while the schedule ran (a
micro-batch's bytes are held from its forward to its full or weight-gradient backward): GPipe holds
every micro-batch on every stage, 1F1B at most the stages after it plus one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ndweave.mesh.agree import gather
from ndweave.mesh.torch_compat import local_tensor, storage_id
from ndweave.pipeline.timeline import Action

__all__ = ["ActivationMeter", "PipelineReport", "StageReport", "build_stage_reports", "count_saved_bytes", "gather_report"]


@dataclass(frozen=True)
class StageReport:
    """One stage's share of the last recorded step."""

    stage: int
    """The stage index (of the whole pipeline)."""
    pp_rank: int
    """The PP rank that runs it."""
    forward_seconds: float
    """Its forwards' time, summed over the micro-batches."""
    backward_seconds: float
    """Its backwards' time (full, input-grad and weight-grad), summed over the micro-batches."""
    param_bytes: int
    """The bytes of its parameters on this rank (a DTensor's local shard)."""
    peak_activation_bytes: int
    """The most bytes saved for backward its micro-batches held at once (parameters not counted)."""
    sent_bytes: int
    """The bytes it handed to the next stage, summed over the micro-batches (0 on the last stage)."""

    @property
    def seconds(self) -> float:
        """Forward and backward time together."""
        return self.forward_seconds + self.backward_seconds


@dataclass(frozen=True)
class PipelineReport:
    """Every stage's :class:`StageReport`, by stage index."""

    stages: list[StageReport]

    @property
    def imbalance(self) -> float:
        """The slowest stage's time over the stages' mean time (1.0: every stage took as long)."""
        times = [s.seconds for s in self.stages]
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    def text(self) -> str:
        """A table, one row per stage, then the imbalance."""
        lines = ["stage  rank  forward ms  backward ms      params  peak activations        sent"]
        for s in self.stages:
            lines.append(f"{s.stage:>5}  {s.pp_rank:>4}  {1e3 * s.forward_seconds:>10.2f}  {1e3 * s.backward_seconds:>11.2f}"
                         f"  {_size(s.param_bytes):>10}  {_size(s.peak_activation_bytes):>16}  {_size(s.sent_bytes):>10}")
        lines.append(f"imbalance (slowest stage / mean): {self.imbalance:.2f}")
        return "\n".join(lines)


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


class ActivationMeter:
    """Per stage: the bytes each micro-batch's forward saved for backward, held until its backward
    frees them, and the peak of their sum; and the bytes the stage sent. Counts only while the
    engine's recorder is enabled (a Python call per saved tensor)."""

    def __init__(self, recorder) -> None:
        self._recorder = recorder
        self._held: dict[int, dict[int, int]] = {}
        self.peak: dict[int, int] = {}
        self.sent: dict[int, int] = {}

    def start(self) -> None:
        self._held, self.peak, self.sent = {}, {}, {}

    @contextlib.contextmanager
    def forward(self, stage: int, micro_batch: int, params: nn.Module) -> Iterator[None]:
        """Count what the forward of ``micro_batch`` on ``stage`` saves for backward."""
        if not self._recorder.enabled or not torch.is_grad_enabled():
            yield
            return
        held = self._held.setdefault(stage, {})
        with count_saved_bytes(params) as saved:
            yield
        held[micro_batch] = saved[0]
        self.peak[stage] = max(self.peak.get(stage, 0), sum(held.values()))

    def output(self, stage: int, output) -> None:
        """Count the bytes of a forward's ``output`` handed to the next stage."""
        if self._recorder.enabled:
            tensors = output if isinstance(output, (tuple, list)) else (output,)
            self.sent[stage] = self.sent.get(stage, 0) + sum(
                local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if isinstance(t, torch.Tensor))

    def release(self, stage: int, micro_batch: int) -> None:
        """The backward of ``micro_batch`` on ``stage`` is done: its saved tensors are freed."""
        self._held.get(stage, {}).pop(micro_batch, None)


@contextlib.contextmanager
def count_saved_bytes(params: nn.Module) -> Iterator[list[int]]:
    """``[bytes]``: what the forward run inside saves for backward, once per storage, ``params``'
    parameters left out; on meta tensors too (what an estimate runs)."""
    skip = {_storage(p)[0] for p in params.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, num_bytes = _storage(tensor)
        if key not in skip and key not in seen:
            seen.add(key)
            total[0] += num_bytes
        # an alias without grad_fn, as autograd saves a node's own output unhooked: the tensor itself
        # would tie the node to itself through its saved output, a cycle gc cannot see, and split
        # backward (I, W) never runs some nodes (attention), which then outlive the step
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """A key of the memory ``tensor`` keeps alive (shared by its views) and its bytes."""
    local = local_tensor(tensor)
    local = getattr(local, "elem", local)  # a collective's result still in flight wraps its buffer
    try:
        return storage_id(local), local.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # no plain storage (another wrapper subclass)
        return id(local), local.numel() * local.element_size()


def build_stage_reports(actions: list[Action], meter: ActivationMeter, stages: dict[int, nn.Module],
                        pp_rank: int) -> list[StageReport]:
    """This rank's reports: ``stages`` maps each stage index to its chunk."""
    reports = []
    for stage, chunk in stages.items():
        mine = [a for a in actions if a.stage == stage]
        reports.append(StageReport(
            stage, pp_rank,
            forward_seconds=sum(a.end - a.start for a in mine if a.kind == "F"),
            backward_seconds=sum(a.end - a.start for a in mine if a.kind != "F"),
            param_bytes=sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in chunk.parameters()),
            peak_activation_bytes=meter.peak.get(stage, 0),
            sent_bytes=meter.sent.get(stage, 0)))
    return reports


def gather_report(reports: list[StageReport], group: dist.ProcessGroup) -> PipelineReport:
    """Every PP rank's reports, on every PP rank (a collective over ``group``)."""
    everyone = gather(group, reports).values()
    return PipelineReport(sorted((r for rank in everyone for r in rank), key=lambda r: r.stage))
