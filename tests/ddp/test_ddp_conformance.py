"""``ndweave.ddp`` meets the data-parallel contract (``ndweave.mesh.contracts.DataParallelWrapper``)
in every constructor mode a sharded optimizer or a pipeline schedule may be handed, checked with
numbers against one process by ``ndweave.mesh.testing.check_data_parallel``."""

from __future__ import annotations

import pytest

from ndweave.ddp import DDP
from ndweave.mesh.testing import check_data_parallel, distributed


@pytest.mark.parity
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@pytest.mark.parametrize("average_grads", [True, False])
@distributed(world_size=4)
def test_ddp_meets_the_contract_on_dp_and_dp_x_tp(use_distributed_optimizer, average_grads):
    # bucket_size=16: several buckets, and TP's uneven shards inside them
    check_data_parallel(
        lambda module, dp_mesh: DDP(module, dp_mesh, bucket_size=16, average_grads=average_grads,
                                    use_distributed_optimizer=use_distributed_optimizer),
        tensor_parallel_size=2,
    )


@pytest.mark.parity
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@distributed(world_size=2)
def test_ddp_meets_the_contract_without_overlap_or_sync_in_backward(use_distributed_optimizer):
    # everything launched by finish_grad_sync(), one bucket per dtype
    check_data_parallel(
        lambda module, dp_mesh: DDP(module, dp_mesh, bucket_size=None, overlap_grad_reduce=False,
                                    finish_grad_sync_in_backward=False,
                                    use_distributed_optimizer=use_distributed_optimizer),
    )


@pytest.mark.parity
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@pytest.mark.parametrize("average_grads", [True, False])
@distributed(world_size=4, timeout=120)
def test_ddp_meets_the_contract_on_dp_x_ep(use_distributed_optimizer, average_grads):
    # DDP given the (DP, EP) mesh: the EP-sharded weight over DP, the rest over DP x EP, all averaged over 4
    check_data_parallel(
        lambda module, data_mesh: DDP(module, data_mesh, bucket_size=16, average_grads=average_grads,
                                      use_distributed_optimizer=use_distributed_optimizer),
        expert_parallel_size=2,
    )
