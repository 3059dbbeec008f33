"""Sequence-parallel activations between stages: a model tensor- and sequence-parallel inside its
stages (torch's own TP styles) is cut where its residual stream is a ``Shard(1)`` DTensor; that
activation crosses as this rank's local shard (1/TP of the whole, counted on the wire: every P2P
send torch's schedule issues), the receiver rebuilds the DTensor with the same placements, and
training equals one process (float64 strict)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import assert_close, distributed
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage
from pipeline_models import SEQ, VOCAB, WIDTH, Block, batches, loss_fn, train_reference

TP = 2
MICRO_BATCHES = 4
BATCH = 8


class SPLM(nn.Module):
    """Blocks as attributes; the root adds a skip connection over the first two."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.block1, self.block2, self.block3, self.block4 = Block(), Block(), Block(), Block()
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        h = self.block2(self.block1(x)) + x
        return self.head(self.norm(self.block4(self.block3(h))))


def sequence_parallel_plan(chunk: nn.Module) -> dict:
    """torch's TP styles with the residual stream sharded along the sequence (``Shard(1)``) and kept a
    DTensor between layers; only the layers this stage holds (the others are placeholders)."""
    plan = {"wte": RowwiseParallel(input_layouts=torch.distributed.tensor.Replicate(), output_layouts=Shard(1),
                                   use_local_output=False),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=torch.distributed.tensor.Replicate())}
    for i in range(1, 5):
        plan |= {f"block{i}.norm": SequenceParallel(),
                 f"block{i}.fc": ColwiseParallel(input_layouts=Shard(1)),
                 f"block{i}.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    held = {name for name, p in chunk.named_parameters()}
    return {key: style for key, style in plan.items() if any(n.startswith(key + ".") for n in held)}


class SendCounter:
    """Wraps each stage's send ops, as torch's schedule fetches them: the bytes of every P2P send."""

    def __init__(self, stages) -> None:
        self.forward: list[int] = []
        self.backward: list[int] = []
        for stage in stages:
            stage.get_fwd_send_ops = self._counting(stage.get_fwd_send_ops, self.forward)
            stage.get_bwd_send_ops = self._counting(stage.get_bwd_send_ops, self.backward)

    @staticmethod
    def _counting(get_ops, sizes: list[int]):
        def counted(*args, **kwargs):
            ops = get_ops(*args, **kwargs)
            sizes.extend(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

        return counted


@pytest.mark.parity
@distributed(world_size=4, timeout=300)
def test_sequence_parallel_activations_cross_as_local_shards_and_train_like_one_process():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model, data = SPLM(), batches(3, BATCH)
    expected_losses, expected_grads, expected_params = train_reference(model, data)
    mesh = init_device_mesh("cpu", (2, TP), mesh_dim_names=("PP", "TP"))
    first = mesh["PP"].get_local_rank() == 0
    micro = BATCH // MICRO_BATCHES
    whole = micro * SEQ * WIDTH * 8  # one crossing activation of a micro-batch, float64
    # block3: the hidden states cross; block2: block1's output and the skip's x, both Shard(1)
    for point, num_tensors in [("block3", 1), ("block2", 2)]:
        plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=MICRO_BATCHES, split_points=[point])
        module = construct_pipeline_stage(copy.deepcopy(model), plan, mesh, example_inputs=data[0][0][:micro])
        module[0] = parallelize_module(module[0], mesh["TP"], sequence_parallel_plan(module[0]))
        engine = PipeEngine(module, mesh, loss_fn, plan)
        sends = SendCounter(engine.stages)
        engine.recorder.enabled = True  # for the stage report (the last step's)
        received = _capture_received(engine) if not first else None
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.05)
        for step, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = engine(x, y)
            assert_close(loss, expected_losses[step], name=f"split at {point}: loss of step {step}")
            for fqn, p in module.named_parameters():
                assert_close(p.grad, expected_grads[step][fqn], name=f"split at {point}: grad {fqn} step {step}")
            optimizer.step()
        for fqn, p in module.named_parameters():
            assert_close(p, expected_params[fqn], name=f"split at {point}: param {fqn}")
        # every P2P send is a local shard: 1/TP of the whole activation (and of its grad, sent back)
        sent = sends.forward if first else sends.backward
        assert sent == [whole // TP] * (num_tensors * MICRO_BATCHES * len(data)), (point, sent, whole)
        assert (sends.backward if first else sends.forward) == []
        report = engine.stage_report()  # what the engine counts the first stage sent in the last step
        assert report.stages[0].sent_bytes == num_tensors * MICRO_BATCHES * whole // TP, report.text()
        if received is not None:  # the receiver rebuilt the DTensors with the sender's placements
            assert received and all(isinstance(a, DTensor) and a.placements == (Shard(1),)
                                    and a.to_local().shape == (micro, SEQ // TP, WIDTH) for a in received), received
        module.train()


def _capture_received(engine: PipeEngine) -> list:
    """The activations the second stage's chunk is called with (a forward pre-hook, as a user adds one)."""
    seen: list = []
    engine.module[0].register_forward_pre_hook(lambda _, args: seen.extend(args))
    return seen
