"""Test harness for distributed code: real ranks (gloo processes, reused across tests) or a fake
process group in one process.

    from ndweave.mesh.testing import distributed, run_distributed, fake_world

    @distributed(world_size=4)
    def test_allreduce():
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 4
"""

from ndweave.mesh.testing.decorator import distributed
from ndweave.mesh.testing.fake import fake_world
from ndweave.mesh.testing.parity import assert_close, full_tensor
from ndweave.mesh.testing.pool import DistributedTestError, RankFailure, run_distributed, shutdown_pools

__all__ = [
    "DistributedTestError",
    "RankFailure",
    "assert_close",
    "distributed",
    "fake_world",
    "full_tensor",
    "run_distributed",
    "shutdown_pools",
]
