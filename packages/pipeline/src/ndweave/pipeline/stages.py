"""What torch's ``PipelineStage`` runs for the engine: :class:`StageModule` wraps a chunk (feeds it
the received activations or the batch's inputs, hands on what crosses the next cut, casts for
``p2p_dtype``, recomputes) and :class:`Stage` is torch's stage plus data-parallel micro-batch control,
hook-visible weight grads, the schedule picture and, when an action raises, which one."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from ndweave.mesh.contracts import DataParallelWrapper
from ndweave.mesh.torch_compat import PipelineStageBase, is_view
from ndweave.pipeline.faults import Blame
from ndweave.pipeline.inputs import InputLayout
from ndweave.pipeline.plan import ResolvedPlan
from ndweave.pipeline.program import stage_program
from ndweave.pipeline.report import ActivationMeter
from ndweave.pipeline.stage_io import first_tensor
from ndweave.pipeline.ties import HookGate
from ndweave.pipeline.timeline import TimelineRecorder

__all__ = ["Stage", "StageModule", "mesh_lookup"]


class StageModule(nn.Module):
    """What a ``PipelineStage`` runs for one chunk: feeds the received activations the way the model
    takes them, hands on what crosses the next cut (a traced chunk's ``StageIO`` tensors, else the
    first tensor of the chunk's output), casts for ``p2p_dtype``, recomputes."""

    def __init__(self, chunk: nn.Module, stage: int, resolved: ResolvedPlan, blame: Blame) -> None:
        super().__init__()
        self.chunk = chunk
        self.program = stage_program(chunk)
        self.stage = stage
        self.blame = blame
        self.micro_batch: int | None = None  # of the forward running (None: the first step's shape inference)
        self.layout: InputLayout | None = None  # the first stage's: how the batch's flat tensors are passed
        self.first = stage == 0
        self.last = stage == resolved.num_stages - 1
        self.p2p_dtype = resolved.plan.p2p_dtype
        self.recompute = resolved.recomputes(stage)
        self.compute_dtype = next((p.dtype for p in chunk.parameters() if p.is_floating_point()), None)
        self.tp_mesh = next((p.device_mesh for p in chunk.parameters() if isinstance(p, DTensor)), None)

    def forward(self, *args):
        with self.blame.running("forward", self.stage, self.micro_batch):
            kwargs = {}
            if not self.first:
                args = tuple(self._received(a) for a in args)
            elif self.layout is not None:
                args, kwargs = self.layout.rebuild(args)
            if self.recompute:
                out = checkpoint(self._run, *args, use_reentrant=False, **kwargs)
            else:
                out = self._run(*args, **kwargs)
            return tuple(self._sent(t) for t in out) if isinstance(out, tuple) else self._sent(out)

    def _run(self, *args, **kwargs):
        out = self.chunk(*args, **kwargs)
        # a traced stage hands on what the graph sent, not what a wrapper's output hook made of it
        # (use_local_output turns a replicated DTensor into a plain tensor, which the next stage could
        # not tell from one that always was plain: torch carries a DTensor across with its placements)
        return self.program.sent if self.program is not None and not self.last else first_tensor(out)

    def _sent(self, out: torch.Tensor) -> torch.Tensor:
        if self.p2p_dtype is not None and not self.last and out.is_floating_point():
            out = out.to(self.p2p_dtype)
        # torch's split backward detach_()es stage outputs, which a view refuses; and the process
        # groups send contiguous tensors only (a permuted or expanded value crossing a cut is not)
        if is_view(out) or not out.is_contiguous():
            out = out.clone(memory_format=torch.contiguous_format)
        return out

    def _received(self, activation: torch.Tensor) -> torch.Tensor:
        if activation.requires_grad:
            activation = _ContiguousGrad.apply(activation)
        if activation.is_floating_point() and self.compute_dtype is not None and activation.dtype != self.compute_dtype:
            activation = activation.to(self.compute_dtype)
        if self.program is None and self.tp_mesh is not None and not isinstance(activation, DTensor):
            # a tensor-parallel chunk handed on a replicated output as a plain tensor (DModule's
            # use_local_output): it is Replicate over the TP mesh, and the next chunk's layers expect that
            activation = DTensor.from_local(activation, self.tp_mesh, [Replicate()] * self.tp_mesh.ndim, run_check=False)
        return activation


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: torch sends a received value's
    gradient back as autograd made it, and the process groups send contiguous tensors only (the
    gradient of a position bias every layer adds, expanded over the batch, is not)."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor) -> torch.Tensor:
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def mesh_lookup(chunk: nn.Module):
    """``get_mesh`` for torch's stage: find a DTensor activation's mesh among the chunk's meshes."""
    meshes = {}
    for p in chunk.parameters():
        if isinstance(p, DTensor):
            meshes.setdefault(tuple(p.device_mesh.mesh_dim_names or ()), p.device_mesh)

    def get_mesh(dim_names, *_):
        if tuple(dim_names or ()) in meshes:
            return meshes[tuple(dim_names or ())]
        raise KeyError(f"no mesh with dims {dim_names} among this stage's parameters' meshes {list(meshes)}")

    return get_mesh


class Stage(PipelineStageBase):
    """torch's ``PipelineStage`` plus data-parallel micro-batch control, hook-visible weight grads, the
    schedule picture and, when an action raises, which one (the methods overridden are pinned in
    ``ndweave.mesh.torch_compat.PIPELINE_STAGE_OVERRIDES``)."""

    def configure(self, chunk: nn.Module, defer_sync: bool, gate: HookGate, recorder: TimelineRecorder,
                  meter: ActivationMeter, blame: Blame) -> None:
        self._data_parallel = chunk if isinstance(chunk, DataParallelWrapper) else None
        self._defer_sync = defer_sync  # a shared weight's copy: the sync waits for the cross-stage sum
        self._gate = gate
        self._recorder = recorder
        self._meter = meter
        self._blame = blame

    def shape_inference_buffer(self, arg, tensor):
        # torch's shape inference runs a stage on uninitialized buffers: an int tensor crossing a cut
        # (position ids) may index an embedding there, so it gets zeros instead of whatever was in memory
        if not isinstance(arg, torch.Tensor) and not tensor.is_floating_point():
            tensor.zero_()
        return tensor

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.submod.micro_batch = fwd_chunk_id
        with (self._recorder.action(self.stage_index, "F", fwd_chunk_id),
              self._meter.forward(self.stage_index, fwd_chunk_id, self.submod)):
            output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if not self.is_last:
            self._meter.output(self.stage_index, output)
        return output

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        with (self._recorder.action(self.stage_index, "B" if full_backward else "I", bwd_chunk_id),
              self._blame.running("backward" if full_backward else "input-grad backward", self.stage_index,
                                  bwd_chunk_id)):
            result = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward:
            self._meter.release(self.stage_index, bwd_chunk_id)
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with (self._recorder.action(self.stage_index, "W", bwd_chunk_id),
              self._blame.running("weight-grad backward", self.stage_index, bwd_chunk_id)):
            result = super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self._meter.release(self.stage_index, bwd_chunk_id)
        return result

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if self._data_parallel is not None:
            self._data_parallel.set_is_last_microbatch(last_backward and not self._defer_sync)
        if backward_type != "weight" or self._data_parallel is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # torch's weight step: autograd.grad, then ``.grad += dw`` by hand. Take the dw it computed and
        # accumulate it through autograd instead, so the wrapper's post-accumulate hooks (DDP's
        # buckets) see it. (A chunk without a wrapper keeps torch's way: nothing hooks its grads.)
        params = list(self.submod.parameters())
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        fresh = [(p, p.grad) for p in params if p.grad is not None]
        for p, grad in zip(params, before):
            p.grad = grad
        if fresh:
            with self._gate.pause():  # the capture hooks already saw these grads inside autograd.grad
                torch.autograd.backward([p.view_as(p) for p, _ in fresh], [g for _, g in fresh])
        return result
