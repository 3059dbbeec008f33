"""Compiling after DDP wraps the model, as users also do (``torch.compile(ddp)``, or the wrapped model
compiled in place: ``ddp.module.compile()``): the grads DDP reduces and the parameters after every step equal one
process's in float64. ZeRO-1 and ZeRO-2 (which need ndweave-optim's DistributedOptimizer) under TP,
and compiling the blocks before wrapping (the way the job and the README compile), are tested in
``tests/integration/test_integration_job_compile.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_cases import MLP, batch, reference_mlp_run, rows
from ndweave.ddp import DDP
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import assert_close, run_distributed
from ndweave.mesh.torch_compat import compile_counts, reset_compile_counts

STEPS = 3


@pytest.mark.parity
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("how", ["whole", "inner"])
def test_compiled_after_wrapping_trains_like_one_process(how, overlap):
    run_distributed(_compiled_after_wrapping, 2, how, overlap, timeout=600)


def _compiled_after_wrapping(how: str, overlap: bool) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    expected, first_grads = reference_mlp_run(STEPS)
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("DP",))
    ddp = DDP(MLP(), mesh["DP"], bucket_size=40, overlap_grad_reduce=overlap)  # (several buckets)
    assert len(ddp.grad_buckets()) > 1
    torch.compiler.reset()  # (a pooled rank may have compiled this MLP for an earlier test)
    if how == "whole":
        model = torch.compile(ddp)
    else:  # (not each nn.Linear: dynamo runs torch's own modules as they are, compiling nothing)
        model = ddp
        ddp.module.compile()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    reset_compile_counts()
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(model(rows(x, rank, size)), rows(y, rank, size)).backward()
        ddp.finish_grad_sync()
        if step == 0:
            for name, p in ddp.named_parameters():
                assert_close(p.grad, first_grads[name], name=f"{name}.grad")
        opt.step()
        opt.zero_grad()
        for name, p in ddp.named_parameters():
            assert_close(p, expected[step][name], name=f"{name} after step {step}")
    assert compile_counts().graphs > 0, "nothing was compiled: the test would not test it"
