"""The traced pipeline composed with the other packages (float64 strict):

* the GPT job with ``--eval-every`` and ``--sample`` on PP=2 x TP(+SP)=2: its validation losses
  (forward only, through the pipeline) and the text it writes (generated through the pipelined,
  tensor-parallel model) equal its own single-device run's;
* greedy generation through nanoGPT on PP=2 and PP=2 x TP=2 (the zoo plan inside stages) equals
  one process token for token;
* a model with its blocks as plain attributes and norms and adds in its root forward, traced and
  cut by parameter count, on PP=2 x DP=2 x TP=2 (DModule TP, DDP with ZeRO, DistributedOptimizer)
  trains like one process under 1F1B and zero bubble: replicated DTensor activations cross the cuts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from integration_models import batches, build
from ndweave.ddp import DistributedDataParallel as DDP
from ndweave.dmodule import get_plan, parallelize_module
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed, run_distributed
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage, generate
from ndweave_gpt.config import parse_args
from ndweave_gpt.loop import train
from ndweave_gpt.reference import train_single_device
from test_integration_pipeline import STEPS, _check, _distributed_optimizer, _reference, _train

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--global-batch", "8",
        "--micro-batches", "2", "--warmup", "2", "--lr", "1e-2", "--min-lr", "1e-3", "--clip", "0.5",
        "--dtype", "float64", "--quiet", "--plot", "", "--metrics", ""]


def _run(argv: list[str]):
    return train(parse_args(argv))


@pytest.mark.parity
def test_job_validation_loss_and_sample_through_the_pipeline_match_one_process(tmp_path):
    argv = [*TINY, "--mesh", "pp=2,tp=2", "--steps", "3", "--eval-every", "2", "--sample", "12",
            "--checkpoint-dir", str(tmp_path)]
    results = run_distributed(_run, 4, argv, timeout=300)
    reference = train_single_device(parse_args(argv))
    assert sorted(reference.val_losses) == [2, 3] and len(reference.sample) > len("ROMEO:\n")
    for rank, result in enumerate(results):
        assert sorted(result.val_losses) == [2, 3], rank
        for step, value in result.val_losses.items():
            assert_close(torch.tensor(value, dtype=torch.float64),
                         torch.tensor(reference.val_losses[step], dtype=torch.float64),
                         name=f"rank {rank}: validation loss of step {step}")
        assert result.sample == reference.sample, f"rank {rank}: {result.sample!r} != {reference.sample!r}"


def _greedy(model, prompt: torch.Tensor, new_tokens: int, block_size: int) -> torch.Tensor:
    tokens = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, model(tokens[:, -block_size:])[0][:, -1].argmax(-1, keepdim=True)], 1)
    return tokens


@pytest.mark.parity
@distributed(world_size=4, timeout=300)
def test_greedy_generation_of_nanogpt_through_pp2_and_pp2_tp2_is_one_process_token_for_token():
    torch.set_default_dtype(STRICT_DTYPE)
    model = build("gpt")
    (x, _), = batches("gpt", 1, 4)
    prompt = x[:2, :3]
    expected = _greedy(model, prompt, 10, model.config.block_size)
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=2)
    for shape, names in [((2, 2), ("PP", "DP")), ((2, 2), ("PP", "TP"))]:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        module = construct_pipeline_stage(copy.deepcopy(model), plan, mesh, example_inputs=x[:2])
        if "TP" in names:
            for i in range(len(module)):
                plan_tp = get_plan("nanogpt", module[i], sequence_parallel=True)
                module[i] = parallelize_module(module[i], mesh["TP"], plan_tp)
        engine = PipeEngine(module, mesh, lambda logits, y: logits.sum(), plan)
        tokens = generate(engine, prompt, 10, max_seq_len=model.config.block_size)
        assert torch.equal(tokens, expected), f"{names}: {tokens.tolist()} != {expected.tolist()}"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class AttributeLM(nn.Module):
    """veScale's test models keep their blocks as ``mlp1 ... mlp4``; the root norms before each and adds."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(64, 32), nn.Embedding(8, 32)
        self.mlp1, self.mlp2, self.mlp3, self.mlp4 = MLP(), MLP(), MLP(), MLP()
        self.ln, self.head = nn.LayerNorm(32), nn.Linear(32, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for i in range(1, 5):
            x = x + getattr(self, f"mlp{i}")(F.layer_norm(x, (32,)))
        return self.head(self.ln(x)), None  # (logits, loss), as nanoGPT


TP_PLAN = {  # Megatron's MLP per block; the rest replicated, plain token ids read as replicated
    "parameter": {r"mlp\d.fc1.(weight|bias)": [Shard(0)], r"mlp\d.fc2.weight": [Shard(1)],
                  r"mlp\d.fc2.bias": [Replicate()]},
    "forward": {r"mlp\d.fc1.input": [[Replicate()]], r"mlp\d.fc2.output": [[Replicate()]],
                "embed.input": [[Replicate()]], "pos.input": [[Replicate()]]},
}


@pytest.mark.parity
@pytest.mark.heavy
@distributed(world_size=8, timeout=600)
def test_blocks_as_attributes_on_pp_dp_tp_train_like_one_process():
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference, data = AttributeLM(), batches("gpt", STEPS, 8)
    expected = _reference(reference, data)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))
    for schedule in ("1f1b", "zero_bubble"):
        plan = PipelineParallelPlan(schedule_type=schedule, num_microbatches=2)
        module = construct_pipeline_stage(copy.deepcopy(reference), plan, mesh, example_inputs=data[0][0][:2])
        for i in range(len(module)):
            chunk = parallelize_module(module[i], mesh["TP"], TP_PLAN)
            module[i] = DDP(chunk, mesh["DP"], use_distributed_optimizer=True, bucket_size=500)
        losses = _train(module, mesh, plan, _distributed_optimizer, data, mesh["DP"])
        _check(losses, module, expected, f"AttributeLM PP=2 x DP=2 x TP=2 {schedule}")
