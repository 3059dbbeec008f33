"""Test harness for distributed code: real ranks (gloo processes, reused across tests) or a fake
process group in one process; plus a reference data-parallel wrapper and the contract check any
data-parallel wrapper can be run through (``ReferenceDataParallel``, ``check_data_parallel``); and
the one single-process reference loop parity is checked against (``train_one_process``).

    from ndweave.mesh.testing import distributed, run_distributed

    @distributed(world_size=4)
    def test_allreduce():
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 4
"""

from ndweave.mesh.testing.conformance import check_data_parallel
from ndweave.mesh.testing.decorator import distributed
from ndweave.mesh.testing.parity import (
    SAFETY,
    STRICT,
    STRICT_DTYPE,
    Tolerance,
    assert_close,
    full_tensor,
    max_difference,
    measured_tolerance,
)
from ndweave.mesh.testing.pool import DistributedTestError, RankFailure, run_distributed, shutdown_pools
from ndweave.mesh.testing.reference import ReferenceRun, train_one_process
from ndweave.mesh.testing.reference_dp import ReferenceDataParallel

__all__ = [
    "SAFETY",
    "STRICT",
    "STRICT_DTYPE",
    "Tolerance",
    "DistributedTestError",
    "RankFailure",
    "ReferenceDataParallel",
    "ReferenceRun",
    "assert_close",
    "check_data_parallel",
    "distributed",
    "full_tensor",
    "max_difference",
    "measured_tolerance",
    "run_distributed",
    "shutdown_pools",
    "train_one_process",
]


def __getattr__(name: str):
    # fake_world is used by production code (the planner, cost models): it moved to ndweave.mesh in 0.10
    if name == "fake_world":
        from ndweave.mesh._moved import moved

        return moved("ndweave.mesh.testing.fake_world", "ndweave.mesh.fake", "fake_world",
                     distribution="ndweave-mesh")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
