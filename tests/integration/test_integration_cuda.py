"""The demo's composition (DModule TP+SP, DDP, DistributedOptimizer) on GPUs with NCCL.

Skipped where fewer than 2 CUDA devices are visible; run on a GPU machine with
``python -m pytest tests/integration/test_integration_cuda.py``.
"""

import copy

import pytest
import torch

from integration_models import load_example
from ndweave.mesh import DEVICE_MESH
from ndweave.mesh.testing import assert_close, run_distributed

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def _demo_on_cuda(dp: int, tp: int) -> float:
    demo = load_example("train_demo")
    args = demo.argparse.Namespace(dp=dp, tp=tp, no_sp=False, steps=4, batch=4, lr=3e-3, seed=3)
    DEVICE_MESH.init_device_mesh("cuda", (dp, tp), mesh_dim_names=("DP", "TP"))
    cfg = demo.model_config()
    data = demo.make_batches(cfg, args.steps, args.batch, args.seed)
    torch.manual_seed(args.seed)
    initial = demo.GPT(cfg).to("cuda")
    losses, model = demo.train_parallel(copy.deepcopy(initial), data, args, "cuda")
    ref_losses, ref_params = demo.train_reference(copy.deepcopy(initial), data, args, "cuda")
    loss_tol, param_tol = demo.measured_bounds(initial, data, args, "cuda", (ref_losses, ref_params))
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), name="losses", tol=loss_tol)
    for name, p in model.named_parameters():
        assert_close(p, ref_params[name], name=name, tol=param_tol)
    for p in model.parameters():
        assert p.device.type == "cuda"
    return losses[-1]


@needs_two_gpus
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_demo_composition_on_two_gpus(dp, tp):
    run_distributed(_demo_on_cuda, 2, dp, tp, device_type="cuda", timeout=300)
