"""Pipeline stages composed with the other packages on one mesh, trained like one process (float64
strict): nanoGPT (tied wte / lm_head on the first and last stage) split by FQN,

* PP x DP: ndweave DDP (ZeRO layout) per chunk + DistributedOptimizer with clipping, every schedule;
* PP x TP: the zoo's nanogpt TP plan applied to each chunk unchanged, from ``deferred_init``, with
  DDP over a DP dim of size 1 so the DistributedOptimizer steps it, every schedule;
* PP x DP x TP on 8 ranks: all of it at once, every schedule.

Losses of every step and the final parameters are compared (a sharded optimizer keeps reduced
grads only in its shard ranges, so they are checked through the parameters they move).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from integration_models import batches, build
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import deferred_init, get_plan, parallelize_module
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed, train_one_process
from ndweave.optim import BasicOptimizer, DistributedOptimizer
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage
from ndweave_gpt.models.nanogpt import GPT

STEPS, BATCH, CLIP, LR = 10, 8, 0.5, 1e-2
# nanoGPT (n_layer=2) split by FQN into 2 stages, or balanced by parameter count into 4
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zero_bubble", 2)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _plan(schedule: str, virtual: int) -> PipelineParallelPlan:
    points = ["transformer.h.1"] if virtual == 1 else None
    return PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=4, split_points=points)


def _reference(model, data):
    run = train_one_process(model, data, optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
                            loss_fn=lambda output, y: loss_fn(output[0], y), clip=CLIP, copy_model=True)
    return [torch.tensor(value) for value in run.losses], run.final


def _train(module, mesh, plan, make_optimizer, data, dp_mesh=None):
    engine = PipeEngine(module, mesh, loss_fn, plan)  # before the optimizer: it marks the second tied copy
    optimizer = make_optimizer(list(module.chunks))
    rank, size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    losses = []
    for x, y in data:
        n = x.shape[0] // size
        optimizer.zero_grad()
        loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        optimizer.step()
        if dp_mesh is not None:
            torch.distributed.all_reduce(loss, group=dp_mesh.get_group())
            loss /= size
        losses.append(loss)
    return losses


def _distributed_optimizer(chunks):
    return DistributedOptimizer(torch.optim.AdamW, models=chunks, clip_grad=CLIP, optimizer_kwargs={"lr": LR})


def _basic_optimizer(chunks):
    return BasicOptimizer(torch.optim.AdamW, models=chunks, clip_grad=CLIP, optimizer_kwargs={"lr": LR})


def _check(losses, module, expected, what):
    ref_losses, ref_params = expected
    for step, (loss, ref) in enumerate(zip(losses, ref_losses, strict=True)):
        assert_close(loss, ref, name=f"{what}: loss of step {step}")
    named = dict(module.named_parameters(remove_duplicate=False))
    assert named
    for fqn, param in named.items():
        assert_close(param, ref_params[fqn], name=f"{what}: param {fqn}")


def _every_schedule(mesh, what, whole_model, tensor_parallel=False):
    """nanoGPT cut by every schedule's plan over ``mesh`` (``"PP"`` and ``"DP"`` dims, ``"TP"`` when
    ``tensor_parallel``), each chunk TP-parallelized (zoo plan) and wrapped in DDP with the ZeRO
    layout, stepped by a DistributedOptimizer: losses and parameters equal one process's.
    ``whole_model(reference)`` gives the model to cut (a copy, or a deferred-init one)."""
    torch.set_default_dtype(STRICT_DTYPE)
    reference, data = build("nanogpt"), batches("gpt", STEPS, BATCH)
    expected = _reference(reference, data)
    for schedule, virtual in SCHEDULES:
        plan = _plan(schedule, virtual)
        module = construct_pipeline_stage(whole_model(reference), plan, mesh, example_inputs=data[0][0][:2])
        for i in range(len(module)):
            chunk = parallelize_module(module[i], mesh["TP"], get_plan("nanogpt", module[i])) if tensor_parallel \
                else module[i]
            module[i] = DDP(chunk, mesh["DP"], use_distributed_optimizer=True, bucket_size=500)
        losses = _train(module, mesh, plan, _distributed_optimizer, data, mesh["DP"])
        _check(losses, module, expected, f"{what} {schedule} v={virtual}")


@pytest.mark.parity
@distributed(world_size=4, timeout=300)
def test_pipeline_with_ddp_and_distributed_optimizer_every_schedule():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "DP"))
    _every_schedule(mesh, "PP=2 x DP=2", copy.deepcopy)


@pytest.mark.parity
@pytest.mark.heavy
@distributed(world_size=4, timeout=300)
def test_pipeline_with_zoo_tensor_parallel_plan_from_deferred_init():
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("PP", "DP", "TP"))
    def deferred(reference):
        torch.manual_seed(0)  # build() seeds 0: deferred init replays exactly what eager init drew
        return deferred_init(GPT, reference.config)

    _every_schedule(mesh, "PP=2 x TP=2", deferred, tensor_parallel=True)


@pytest.mark.parity
@pytest.mark.heavy
@distributed(world_size=8, timeout=400)
def test_pipeline_data_tensor_parallel_on_eight_ranks():
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))
    _every_schedule(mesh, "PP=2 x DP=2 x TP=2", copy.deepcopy, tensor_parallel=True)


@pytest.mark.parity
@distributed(world_size=4, timeout=300)
def test_hf_llama_split_by_fqn_with_zoo_plan_inside_stages():
    transformers = pytest.importorskip("transformers")
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                                      attention_dropout=0.0, attn_implementation="sdpa", use_cache=False)
    reference = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    data = [(ids[:, :-1], ids[:, 1:]) for ids in (torch.randint(0, 128, (BATCH, 9), generator=g) for _ in range(4))]

    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(input_ids=x).logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        ref_losses.append(loss.detach())

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "TP"))
    # traced: the mask, the (cos, sin) tables and the position ids cross the cut with the hidden states
    for how in ({"example_inputs": data[0][0][:2]},):
        plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=2, split_points=["model.layers.1"])
        module = construct_pipeline_stage(copy.deepcopy(reference), plan, mesh, example_inputs=how.get("example_inputs"))
        module[0] = parallelize_module(module[0], mesh["TP"], get_plan("hf_llama", module[0]))
        losses = _train(module, mesh, plan, _basic_optimizer, data)
        _check(losses, module, (ref_losses, dict(model.named_parameters())), f"hf_llama PP=2 x TP=2 1f1b {list(how)}")
