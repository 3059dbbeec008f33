"""``PipeEngine``: one training step of a ``PipeModule`` under a torch pipelining schedule.

torch runs the schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``, ...) over ``PipelineStage`` objects built on the PP dim's process
group. The engine adds what composition needs:

* **Loss scaling.** The schedule's loss is ``loss_fn(output, target) / num_microbatches`` and torch's
  own grad scaling is off, so the grads that reach ``.grad`` (or a data-parallel wrapper's buckets)
  are those of the mean micro-batch loss with no division afterwards (which would miss grads a
  wrapper keeps in its buckets).
* **Data-parallel sync** through ``ndweave.mesh.contracts.DataParallelWrapper`` only: each backward
  of a wrapped chunk is told whether it is that chunk's last of the step (torch's schedules say so,
  counting split weight-gradient steps too), so the wrapper accumulates until then and launches its
  sync from the last one. Zero-bubble's weight step computes grads with ``autograd.grad`` and adds
  them to ``.grad`` by hand, past the hooks wrappers accumulate with; the engine hands them to
  autograd's own accumulation instead (see :class:`~ndweave.pipeline.stages.Stage`).
* **Shared weights** (``ties.py``): grads of a weight held by several stages are summed across them
  before the data-parallel sync.
* **Faults** (``faults.py``): the engine communicates on a process group of its own over the PP
  ranks; a step that raises on one rank aborts it there, and every PP rank raises
  :class:`PipelineStageError` within seconds instead of waiting in a receive.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ndweave.mesh import ParallelMesh, resolve_mesh
from ndweave.mesh.contracts import DataParallelWrapper, finish_grad_sync
from ndweave.mesh.lifecycle import destroy_side_group, new_side_group
from ndweave.mesh.torch_compat import abort_group, compiled_backward_retained, group_timeout, pipeline_stage_kwargs
from ndweave.pipeline.agree import BatchShapes, agree_on_batch, agree_on_plan
from ndweave.pipeline.construct import PipeModule, chunk_device
from ndweave.pipeline.evaluate import evaluate_batch
from ndweave.pipeline.faults import Blame, Failure, FailureRecord, PipelineStageError, detach_traceback
from ndweave.pipeline.inputs import (InputLayout, ModelInputs, check_inputs, check_same_inputs, check_targets,
                                     flatten_inputs, input_shapes, split_inputs)
from ndweave.pipeline.plan import PipelineParallelPlan, ResolvedPlan, resolve_plan
from ndweave.pipeline.program import stage_program
from ndweave.pipeline.report import ActivationMeter, PipelineReport, build_stage_reports, gather_report
from ndweave.pipeline.stages import Stage, StageModule, mesh_lookup
from ndweave.pipeline.ties import HookGate, TiedGradSync, check_shared_params
from ndweave.pipeline.timeline import ScheduleTimeline, TimelineRecorder

__all__ = ["PipeEngine"]


class PipeEngine:
    """Runs forward and backward of a mini-batch through the pipeline; returns the mean micro-batch loss.

    ::

        module = construct_pipeline_stage(model, plan, mesh)
        engine = PipeEngine(module, mesh, F.cross_entropy, plan)
        for x, y in batches:                    # x needed on the first stage, y on the last (else None)
            optimizer.zero_grad()
            loss = engine(x, y)                 # the same value on every PP rank
            # several inputs: engine((ids, mask), y) or engine({"input_ids": ids, "attention_mask": mask}, y)
            optimizer.step()
        engine.close()                          # its process group and buffers released

    Build it after wrapping / parallelizing the chunks (``module[i] = DDP(module[i], ...)``): it reads
    the chunks and the shared weights' parameters once. When a call returns, every chunk's grads are
    final: summed across stages for shared weights, synced over DP, ``Partial`` grads reduced.

    Args:
        module: this rank's chunks, from :func:`construct_pipeline_stage`.
        mesh: the mesh with the ``"PP"`` dim (a ``ParallelMesh``, a named ``DeviceMesh``, or ``None``
            for the default ``DEVICE_MESH``).
        loss_fn: ``loss_fn(output, target)`` on the last stage's output for one micro-batch; for grads
            equal to one device's, a mean over the micro-batch. A ``loss_fn(output)`` of one argument
            needs no targets (``engine(x)``).
        plan: the plan the module was built with (default: that one).
    """

    def __init__(self, module: PipeModule, mesh: ParallelMesh | DeviceMesh | None = None, loss_fn=None,
                 plan: PipelineParallelPlan | None = None) -> None:
        if not isinstance(module, PipeModule):
            raise TypeError(f"PipeEngine runs a PipeModule from construct_pipeline_stage; got {type(module).__name__}")
        if loss_fn is None:
            raise ValueError("PipeEngine needs loss_fn(output, target) for the last stage")
        if not callable(loss_fn):
            raise TypeError(f"PipeEngine: loss_fn must be a callable loss_fn(output, target), got {loss_fn!r}")
        if plan is not None and not isinstance(plan, PipelineParallelPlan):
            raise TypeError(f"PipeEngine: plan must be a PipelineParallelPlan (or None: the module's), got {type(plan).__name__}")
        pp_mesh = resolve_mesh(mesh, "PP")
        pp_ranks = pp_mesh.mesh.flatten().tolist()

        def local_checks() -> ResolvedPlan:
            resolved = resolve_plan(plan or module.resolved_plan.plan, pp_mesh.size())
            if resolved.num_stages != module.num_stages or resolved.stages_of(pp_mesh.get_local_rank()) != list(module.stage_indices):
                raise ValueError("the plan and mesh give other stages than the module was built with; pass the same plan and mesh")
            check_shared_params(module.chunks, module.stage_indices, module.shared_params)
            return resolved

        # before any stage talks to another: a PP rank built from another plan would wait forever, and
        # an error one rank's checks raise is raised on every rank
        resolved, engine_id = agree_on_plan(plan or module.resolved_plan.plan, pp_mesh.get_group(), local_checks)
        self.module = module
        self.loss_fn = loss_fn
        self._loss_takes_targets = _takes_targets(loss_fn)
        self.resolved = resolved
        self.pp_mesh = pp_mesh
        self.recorder = TimelineRecorder()
        self._meter = ActivationMeter(self.recorder)
        self._first_batch: BatchShapes | None = None
        self._first_inputs: dict[str, tuple[int, ...]] | None = None  # every input's, on the first stage
        self._failure: Failure | None = None
        self._closed = False
        self._record = FailureRecord(engine_id, pp_mesh.get_local_rank(), pp_mesh.size())
        self._blame = Blame()
        self._gate = HookGate()
        self._rank_of_stage = lambda stage: pp_ranks[resolved.stage_rank(stage)]
        self._group = group = _engine_group(pp_mesh)
        self._ties = TiedGradSync(module.chunks, module.stage_indices, module.shared_params, self._rank_of_stage,
                                  group, self._gate)
        deferred = self._ties.chunk_indices()
        self.stages = [
            Stage(StageModule(chunk, stage, resolved, self._blame), stage, resolved.num_stages,
                   chunk_device(chunk, pp_mesh.device_type), group=group, **pipeline_stage_kwargs(mesh_lookup(chunk)))
            for stage, chunk in zip(module.stage_indices, module.chunks)
        ]
        for index, stage in enumerate(self.stages):
            stage.configure(module.chunks[index], index in deferred, self._gate, self.recorder, self._meter, self._blame)
        kwargs = dict(n_microbatches=resolved.num_microbatches, loss_fn=self._micro_batch_loss, scale_grads=False)
        cls = resolved.schedule
        self.schedule = cls(self.stages[0], **kwargs) if resolved.single_stage else cls(self.stages, **kwargs)
        # a split backward (I, then W) keeps each micro-batch's graph between the two: a compiled block's
        # backward must allow that (compiled at the first step, inside the schedule)
        self._splits_backward = any(action is not None and action.computation_type.value == "W"
                                    for actions in (getattr(self.schedule, "pipeline_order", None) or {}).values()
                                    for action in actions)

    # ------------------------------------------------------------------ one step
    def __call__(self, inputs: ModelInputs | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one mini-batch; returns the mean micro-batch loss (float64, detached).

        ``inputs`` (on the first stage): a tensor, a tuple of tensors (the forward's positional
        arguments) or a dict name -> tensor (its keyword arguments), every tensor split into
        micro-batches along dim 0; every step passes the same inputs (names, shapes) as the first.
        Raises :class:`PipelineStageError` on every PP rank when the step raises on any of them, and
        the same ``ValueError`` on every PP rank for a batch one of them refuses."""
        self._check_usable()
        first = 0 in self.module.stage_indices
        last = self.resolved.num_stages - 1 in self.module.stage_indices
        layout = shapes_now = None
        try:
            if first:
                layout, shapes_now = self._check_model_inputs(inputs, self._first_inputs)
            if last and self._loss_takes_targets:
                check_targets(targets, self.resolved.num_microbatches)
            if last and not self._loss_takes_targets and targets is not None:
                raise ValueError("loss_fn takes the output alone (loss_fn(output)), yet targets were given; pass "
                                 "none, or a loss_fn(output, targets)")
            error = None
        except ValueError as local:
            error = str(local)
        self._blame.reset()
        try:
            # every PP rank sees every rank's check (one small gather per step), so all raise or none does
            shapes = agree_on_batch(error, flatten_inputs(inputs)[1][0] if first and error is None else None,
                                    targets if last else None, self._group, self._first_batch, self.pp_mesh.device_type)
        except ValueError:
            raise  # a batch refused on every PP rank alike: the engine runs on
        except Exception as failed:  # a peer failed after its part of the last step
            self._fail(failed)
        self._first_batch = self._first_batch or shapes
        self._first_inputs = self._first_inputs or shapes_now
        losses: list[torch.Tensor] = []
        self._ties.begin()
        try:
            self.recorder.start()
            self._meter.start()
            if last and not self._loss_takes_targets:  # torch's schedule splits a target: give it rows to split
                targets = torch.empty((self.resolved.num_microbatches, 0), device=self.stages[0].device)
            with compiled_backward_retained() if self._splits_backward else contextlib.nullcontext():
                self.schedule.step(*(self._feed(inputs, layout) if first else ()), target=targets if last else None,
                                   losses=losses, return_outputs=False)
            self.recorder.stop()
            self._ties.finish(self._deliver)
            with self._blame.running("the data-parallel grad sync after the schedule (finish_grad_sync)"):
                finish_grad_sync(list(self.module.chunks))
            return self._broadcast_loss(losses, last)
        except Exception as failed:
            self._ties.cancel()  # no capture hooks left behind on the parameters
            self._fail(failed)
        except BaseException:
            self._ties.cancel()
            raise

    def evaluate(self, inputs: ModelInputs | None = None, targets: torch.Tensor | None = None):
        """Forward only (no backward, under ``no_grad``) of a mini-batch through the schedule::

            val_loss = engine.evaluate(x, y)   # the mean micro-batch loss (float64), on every PP rank
            logits = engine.evaluate(x)        # the last stage's outputs on its rank, None on the others

        ``inputs`` on the first stage (a tensor, a tuple or a dict, as in training); ``targets`` on the
        last (none: the outputs, the micro-batches' concatenated along dim 0). The chunks run in the
        mode they are in: call ``module.eval()``
        first to turn dropout off, ``module.train()`` after. Every evaluation batch has the first
        one's shape (it may differ from the training batch's)."""
        return evaluate_batch(self, inputs, targets)

    def _micro_batch_loss(self, output, target):
        # divided here, not in torch's scale_grads (which divides .grad after the fact and so would
        # miss grads a data-parallel wrapper keeps in its own buckets)
        stage = next(s for s in self.stages if s.is_last)
        with self._blame.running("loss_fn", stage.stage_index, stage.submod.micro_batch):
            loss = self.loss_fn(output, target) if self._loss_takes_targets else self.loss_fn(output)
            loss = loss / self.resolved.num_microbatches
        self.recorder.extend(stage.stage_index, "F", stage.submod.micro_batch)  # the loss is the forward's work
        return loss

    def close(self) -> None:
        """Release what the engine holds: the schedule and its stages (their activation and receive
        buffers), the shared weights' sync, and its own process group over the PP ranks (destroyed;
        the mesh's groups and the chunks are left as they are). Call it on every PP rank after the
        last step; a second call does nothing, a step after it raises. ``with PipeEngine(...) as
        engine:`` and ``ndweave.mesh.shutdown(engine)`` call it too."""
        if self._closed:
            return
        self._closed = True
        group, self._group = self._group, None  # None already after a failed step (aborted then)
        self.schedule = self.stages = self._ties = None
        if group is not None and self.pp_mesh.size() > 1:
            destroy_side_group(group)

    def __enter__(self) -> PipeEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise PipelineStageError(self._failure, again=True)
        if self._closed:
            raise RuntimeError("this PipeEngine is closed (close()): build a new one to run more steps")

    def _fail(self, error: Exception) -> NoReturn:
        """Raise ``error`` as this step's failure on every PP rank: publish it (or read the failure a
        peer published first), then abort the engine's group so that the ranks waiting on this one
        fail too (see ``faults.py``)."""
        where = self._blame.describe(error, self._chunk_of_stage)
        self._failure = self._record.settle(error, where)
        cause = detach_traceback(error)
        group, self._group = self._group, None
        self.schedule = self.stages = self._ties = None  # they hold the group, which gloo closes once freed
        if self.pp_mesh.size() > 1:
            abort_group(group)
        del group, error
        gc.collect()  # what reference cycles still hold of it (its pending receives) goes too
        raise PipelineStageError(self._failure) from cause

    def _chunk_of_stage(self, stage: int) -> nn.Module:
        return self.module.chunks[list(self.module.stage_indices).index(stage)]

    def _check_model_inputs(self, inputs, first: dict[str, tuple[int, ...]] | None):
        """The first stage's check of ``inputs``: their layout and each one's shape. The first input's
        shape is compared with the first batch's by :func:`agree_on_batch` on every rank (with the
        targets'); the names, and the other inputs' shapes, here."""
        layout = check_inputs(inputs, self.resolved.num_microbatches)
        program = stage_program(self.module.chunks[0])  # (stage 0's: this rank holds the first stage)
        if program is not None:  # a traced model: the inputs its trace took, by name
            try:
                program.bind(*split_inputs(inputs))
            except TypeError as error:
                raise ValueError(str(error)) from None
        now = input_shapes(inputs)
        if first is not None:
            if list(now) != list(first):
                check_same_inputs(now, first)  # (raises: other names)
            check_same_inputs(dict(list(now.items())[1:]), dict(list(first.items())[1:]))
        return layout, now

    def _feed(self, inputs, layout: InputLayout) -> tuple[torch.Tensor, ...]:
        """The flat tensors torch's schedule splits into micro-batches; the first stage's module
        rebuilds the forward's arguments from them (``layout``)."""
        for stage in self.stages:
            stage.submod.layout = layout
        return flatten_inputs(inputs)[1]

    def _deliver(self, index: int, params: list, grads: list) -> None:
        """Run one backward that adds ``grads`` into ``params`` of chunk ``index`` as its last micro-batch."""
        chunk = self.module.chunks[index]
        if isinstance(chunk, DataParallelWrapper):
            chunk.set_is_last_microbatch(True)
        with self._gate.pause(), self._blame.running("the backward handing shared weights' grads to their chunks"):
            torch.autograd.backward([p.view_as(p) for p in params], grads)

    def _broadcast_loss(self, losses: list[torch.Tensor], last: bool) -> torch.Tensor:
        device = self.stages[0].device
        if last:
            values = [(l.full_tensor() if isinstance(l, DTensor) else l).detach().to(torch.float64) for l in losses]
            loss = torch.stack(values).sum().to(device)
        else:
            loss = torch.zeros((), dtype=torch.float64, device=device)
        if self.pp_mesh.size() > 1:
            dist.broadcast(loss, src=self._rank_of_stage(self.resolved.num_stages - 1), group=self._group)
        return loss

    # ------------------------------------------------------------------ the schedule picture
    def timeline(self) -> ScheduleTimeline:
        """The last step's F/B/W actions per PP rank with their measured times (call on every PP
        rank after a step with ``engine.recorder.enabled = True``); see :class:`ScheduleTimeline`."""
        self._check_usable()
        return self.recorder.gather(self._group, self.resolved)

    def stage_report(self) -> PipelineReport:
        """Each stage's time and memory in the last step recorded with ``engine.recorder.enabled =
        True``: forward and backward seconds, parameter bytes, the peak bytes its micro-batches held
        for backward, the bytes it sent on (call on every PP rank: it gathers)::

            print(engine.stage_report().text())   # one row per stage, then the imbalance

        See :class:`~ndweave.pipeline.report.PipelineReport`."""
        self._check_usable()
        if not self.recorder.actions:
            raise RuntimeError("no step recorded: set engine.recorder.enabled = True, then run a step")
        chunks = dict(zip(self.module.stage_indices, self.module.chunks))
        return gather_report(build_stage_reports(self.recorder.actions, self._meter, chunks,
                                                 self.pp_mesh.get_local_rank()), self._group)


def _takes_targets(loss_fn) -> bool:
    """Whether ``loss_fn`` is ``loss_fn(output, targets)``; ``False`` for a loss of the output alone
    (one positional parameter: veScale's ``loss_fn(output)``, a loss the model computed)."""
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the usual two arguments
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.kind == p.VAR_POSITIONAL for p in params) or len(positional) != 1


def _engine_group(pp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """A process group over the PP ranks for this engine alone (its timeout and backend those of the
    mesh's PP group): aborting it when a step fails leaves the mesh's groups alone, and only the
    engine holds it, so gloo closes its connections once the engine drops it (see ``faults.py``)."""
    mesh_group = pp_mesh.get_group()
    if pp_mesh.size() == 1:
        return mesh_group
    return new_side_group(dist.get_process_group_ranks(mesh_group), desc="pipeline",
                          timeout=group_timeout(mesh_group, pp_mesh.device_type), backend=dist.get_backend(mesh_group))
