"""Output, every gradient, and a few optimizer steps of a DModule match one process.

MLP under TP and TP+SP, a custom-module block (hand-written RMSNorm, GPT-2 Conv1D with its
transposed weight, LayerNorm) under TP+SP, uneven shards, and 2-D TP meshes.
"""

import pytest
import torch
from core_models import MLP, NormMLP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndweave.dmodule import parallelize_module
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed

R, S0, S1 = Replicate(), Shard(0), Shard(1)

MLP_TP = {
    "parameter": {"fc1.weight": [S0], "fc1.bias": [S0], "fc2.weight": [S1]},
    "forward": {"fc1.input": [[R]], "fc2.output": [[R]]},
}
# sequence parallel: activations between blocks stay Shard(seq); the input arrives as the local chunk
MLP_TP_SP = {
    "parameter": {"fc1.weight": [S0], "fc1.bias": [S0], "fc2.weight": [S1]},
    "forward": {".input": [[S1]], "fc1.input": [[R]], "fc2.output": [[S1]]},
}
NORM_MLP_TP_SP = {
    "parameter": {"c_fc.weight": [S1], "c_fc.bias": [S0], "c_proj.weight": [S0]},
    "forward": {".input": [[S1]], "c_fc.input": [[R]], "c_proj.output": [[S1]]},
}
# 2-D TP on a (2, 2) mesh: weights sharded over both mesh dims
MLP_TP_2D = {
    "parameter": {"fc1.weight": [S0, S1], "fc1.bias": [S0, R], "fc2.weight": [S1, S0]},
    "forward": {"fc1.input": [[R, R]], "fc2.output": [[R, R]]},
}
NORM_MLP_TP_SP_2D = {
    "parameter": {"c_fc.weight": [S1, S1], "c_fc.bias": [S0, S0], "c_proj.weight": [S0, S0]},
    "forward": {".input": [[S1, S1]], "c_fc.input": [[R, R]], "c_proj.output": [[S1, S1]]},
}


def _local_chunk(x, mesh, placements):
    """What this rank feeds a model whose plan says its input is already laid out as ``placements``."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(x, mesh, placements, src_data_rank=None).to_local()


def _run_parity(model_fn, plan, mesh, x_shape, seq_parallel, optimizer, steps=3):
    torch.set_default_dtype(STRICT_DTYPE)  # both sides, strict parity (the harness resets it after)
    torch.manual_seed(0)
    ref = model_fn()
    torch.manual_seed(0)
    dmodel = parallelize_module(model_fn(), mesh, plan)
    opt_cls = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
               "adam": lambda p: torch.optim.Adam(p, lr=0.01)}[optimizer]
    ref_opt, dopt = opt_cls(ref.parameters()), opt_cls(dmodel.parameters())
    partial_seen = set()
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(*x_shape)
        placements = plan["forward"][".input"][0] if seq_parallel else None
        out = dmodel(_local_chunk(x, mesh, placements) if seq_parallel else x)
        expected = ref(x)
        assert isinstance(out, DTensor) == seq_parallel  # replicated root outputs come back plain
        assert_close(out, expected, name=f"step {step} output")
        (out * out).sum().backward()
        (expected * expected).sum().backward()
        partial_seen |= {e.fqn for e in dmodel.list_grad_sync()}
        dmodel.finish_grad_sync()
        assert dmodel.list_grad_sync() == [] or all(e.status == "synced" for e in dmodel.list_grad_sync())
        for (name, p), (_, q) in zip(dmodel.named_parameters(), ref.named_parameters()):
            assert not any(pl.is_partial() for pl in p.grad.placements), name
            assert p.grad.placements == p.placements, name
            assert_close(p.grad, q.grad, name=f"step {step} {name}.grad")
        dopt.step()
        ref_opt.step()
        dopt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), (_, q) in zip(dmodel.named_parameters(), ref.named_parameters()):
            assert_close(p, q, name=f"step {step} {name}")
    return partial_seen


def _mesh_1d(world):
    return init_device_mesh("cpu", (world,), mesh_dim_names=("TP",))


def _mesh_2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("TP0", "TP1"))


@pytest.mark.parity
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@distributed(world_size=2)
def test_mlp_tp_world2(optimizer):
    _run_parity(lambda: MLP(4, 8), MLP_TP, _mesh_1d(2), (3, 4), False, optimizer)


@pytest.mark.parity
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@distributed(world_size=4)
def test_mlp_tp_uneven_world4(optimizer):
    # hidden 10 over 4 ranks: shards of 3, 3, 2, 2
    _run_parity(lambda: MLP(5, 10), MLP_TP, _mesh_1d(4), (3, 5), False, optimizer)


@pytest.mark.parity
@distributed(world_size=2)
def test_mlp_tp_sp_world2():
    _run_parity(lambda: MLP(4, 8), MLP_TP_SP, _mesh_1d(2), (2, 6, 4), True, "adam")


@pytest.mark.parity
@distributed(world_size=4)
def test_mlp_tp_sp_world4():
    _run_parity(lambda: MLP(4, 8), MLP_TP_SP, _mesh_1d(4), (2, 8, 4), True, "sgd")


@pytest.mark.parity
@distributed(world_size=2)
def test_custom_modules_tp_sp_world2():
    partial = _run_parity(lambda: NormMLP(8, 16), NORM_MLP_TP_SP, _mesh_1d(2), (2, 6, 8), True, "adam")
    # the norms see sequence-sharded activations: their grads came out Partial and were synced
    assert {"norm.weight", "ln_f.weight", "ln_f.bias"} <= partial, partial


@pytest.mark.parity
@distributed(world_size=4)
def test_custom_modules_tp_sp_world4():
    partial = _run_parity(lambda: NormMLP(8, 16), NORM_MLP_TP_SP, _mesh_1d(4), (2, 8, 8), True, "sgd")
    assert {"norm.weight", "ln_f.weight", "ln_f.bias"} <= partial, partial


@pytest.mark.parity
@distributed(world_size=4)
def test_mlp_2d_tp_mesh():
    _run_parity(lambda: MLP(4, 8), MLP_TP_2D, _mesh_2d(), (3, 4), False, "adam")


@pytest.mark.parity
@distributed(world_size=4)
def test_custom_modules_2d_tp_sp_mesh():
    partial = _run_parity(lambda: NormMLP(8, 16), NORM_MLP_TP_SP_2D, _mesh_2d(), (2, 8, 8), True, "sgd")
    assert "norm.weight" in partial, partial


@distributed(world_size=2)
def test_finish_grad_sync_is_one_collective_per_bucket():
    torch.manual_seed(0)
    dmodel = parallelize_module(NormMLP(8, 16), _mesh_1d(2), NORM_MLP_TP_SP)
    x = _local_chunk(torch.randn(2, 6, 8), dmodel.device_mesh, [S1])
    dmodel(x).pow(2).sum().backward()
    pending = dmodel.list_grad_sync()
    assert {e.fqn for e in pending} == {"norm.weight", "ln_f.weight", "ln_f.bias"}, pending
    calls = []
    original = torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        dmodel.finish_grad_sync()
    finally:
        torch.distributed.all_reduce = original
    assert calls == [8 + 8 + 8], calls  # three Partial grads, one bucket, one all-reduce
