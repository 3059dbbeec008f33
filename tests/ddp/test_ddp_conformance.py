"""``ndweave.ddp`` meets the data-parallel contract (``ndweave.mesh.contracts.DataParallelWrapper``)
in every constructor mode a sharded optimizer or a pipeline schedule may be handed (ZeRO stages 0, 1
and 2), checked with numbers against one process by ``ndweave.mesh.testing.check_data_parallel``."""

from __future__ import annotations

import pytest

from ndweave.ddp import DDP
from ndweave.mesh.testing import check_data_parallel, distributed


@pytest.mark.parity
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("average_grads", [True, False])
@distributed(world_size=4)
def test_ddp_meets_the_contract_on_dp_and_dp_x_tp(zero_stage, average_grads):
    # bucket_size=16: several buckets, and TP's uneven shards inside them
    check_data_parallel(
        lambda module, dp_mesh: DDP(module, dp_mesh, bucket_size=16, average_grads=average_grads,
                                    zero_stage=zero_stage),
        tensor_parallel_size=2,
    )


@pytest.mark.parity
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@distributed(world_size=2)
def test_ddp_meets_the_contract_without_overlap_or_sync_in_backward(zero_stage):
    # everything launched by finish_grad_sync() (ZeRO-2: at the end of each backward), one bucket per dtype
    check_data_parallel(
        lambda module, dp_mesh: DDP(module, dp_mesh, bucket_size=None, overlap_grad_reduce=False,
                                    finish_grad_sync_in_backward=False, zero_stage=zero_stage),
    )


@pytest.mark.parity
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("average_grads", [True, False])
@distributed(world_size=4, timeout=120)
def test_ddp_meets_the_contract_on_dp_x_ep(zero_stage, average_grads):
    # DDP given the (DP, EP) mesh: the EP-sharded weight over DP, the rest over DP x EP, all averaged over 4
    check_data_parallel(
        lambda module, data_mesh: DDP(module, data_mesh, bucket_size=16, average_grads=average_grads,
                                      zero_stage=zero_stage),
        expert_parallel_size=2,
    )
