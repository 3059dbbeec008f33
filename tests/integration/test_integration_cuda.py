"""The GPT job (``ndweave_gpt``: DModule TP+SP, pipeline, DDP, DistributedOptimizer) on GPUs
with NCCL, float64 against its own single-device run on the GPU (strict).

Skipped where fewer than 2 CUDA devices are visible; run on a GPU machine with
``python -m pytest tests/integration/test_integration_cuda.py``.
"""

import pytest
import torch

from ndweave.mesh.testing import assert_close, run_distributed
from ndweave_gpt.config import parse_args
from ndweave_gpt.loop import train
from ndweave_gpt.reference import train_single_device

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--global-batch", "8",
        "--micro-batches", "2", "--steps", "4", "--dtype", "float64", "--device", "cuda", "--quiet", "--plot", "", "--metrics", ""]


def _job_on_cuda(argv: list[str]):
    result = train(parse_args(argv))
    assert torch.cuda.max_memory_allocated() > 0
    return result


@needs_two_gpus
@pytest.mark.parametrize("mesh", ["dp=2", "tp=2", "pp=2"])
def test_gpt_job_on_two_gpus(mesh, tmp_path):
    argv = [*TINY, "--mesh", mesh, "--checkpoint-dir", str(tmp_path)]
    result = run_distributed(_job_on_cuda, 2, argv, device_type="cuda", timeout=300)[0]
    reference = train_single_device(parse_args(argv))
    steps = sorted(result.losses)
    assert_close(torch.tensor([result.losses[s] for s in steps], dtype=torch.float64),
                 torch.tensor([reference.losses[s] for s in steps], dtype=torch.float64),
                 name=f"{mesh}: losses")
    for name, p in result.params.items():
        assert_close(p, reference.params[name], name=f"{mesh}: {name}")
