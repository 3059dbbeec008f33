"""DDP on a mesh with an ``"EP"`` dim: EP ranks split the batch too, so a param sharded over EP (an
expert) is reduced and broadcast over DP only, every other over DP x EP, each in buckets of its own
group. (The grads themselves against one process: ``check_data_parallel(..., expert_parallel_size=2)``
in ``test_ddp_conformance.py``; a real MoE model: ``tests/integration/test_integration_expert_parallel.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ndweave.ddp import DDP
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import distributed


class _TinyMoE(torch.nn.Module):
    """A dense layer and 4 stacked "experts" divided over EP: this rank's 2 drawn here."""

    def __init__(self, ep_mesh) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(3, 3)
        self.experts = torch.nn.Parameter(DTensor.from_local(torch.randn(2, 3, 3), ep_mesh, [Shard(0)]))


@distributed(world_size=4)
def test_experts_and_dense_params_get_buckets_of_their_own_groups():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "EP"))
    torch.manual_seed(dist.get_rank())  # every rank different: DDP's broadcast must make replicas equal
    model = _TinyMoE(mesh["EP"])
    ddp = DDP(model, mesh, use_distributed_optimizer=True)
    assert ddp.data_parallel_size == 4
    groups = {bp.name: dist.get_process_group_ranks(b.data_parallel_group) for b in ddp.grad_buckets() for bp in b.params}
    dp, ep = mesh.get_strategy_coordinate()
    assert groups == {"dense.weight": [0, 1, 2, 3], "dense.bias": [0, 1, 2, 3], "experts": [ep, 2 + ep]}
    # the dense layer from rank 0; each EP rank's experts from its own DP rank 0 (rank ep), not rank 0's
    torch.manual_seed(0)
    expected_dense = torch.nn.Linear(3, 3).weight
    torch.manual_seed(ep)
    torch.nn.Linear(3, 3)
    expected_experts = torch.randn(2, 3, 3)
    assert torch.equal(model.dense.weight, expected_dense)
    assert torch.equal(model.experts.to_local(), expected_experts)


@distributed(world_size=2)
def test_an_ep_mesh_without_dp_splits_the_batch_over_ep():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("EP",))
    ddp = DDP(_TinyMoE(mesh), mesh)
    assert ddp.data_parallel_size == 2
    by_name = {bp.name: b.data_parallel_group for b in ddp.grad_buckets() for bp in b.params}
    assert by_name["experts"] is None and dist.get_process_group_ranks(by_name["dense.weight"]) == [0, 1]


@distributed(world_size=4)
def test_experts_with_only_the_dp_dim_given_are_refused_naming_the_mesh_to_pass():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "EP"))
    with pytest.raises(ValueError, match=r"'experts' is sharded over the expert-parallel dim 'EP'.*only the data dims "
                                         r"\['DP'\].*DDP\(model, mesh\)"):
        DDP(_TinyMoE(mesh["EP"]), mesh["DP"])
