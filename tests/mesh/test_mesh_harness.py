"""The harness itself: results per rank, failing, dying and hanging ranks reported with their stacks; a
rank that raises stops the others at once."""

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import DistributedTestError, distributed, run_distributed


def _rank_and_sum(scale):
    if not dist.is_initialized():  # a pool that leaves the process group to the test
        init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    print("hello from", dist.get_rank())
    return dist.get_rank() * scale, t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ZeroDivisionError("rank one divided by zero")
    return "fine"


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(3600)  # the marker we expect in the stack dump
    dist.barrier()


def _raise_on_one_while_zero_receives():
    if not dist.is_initialized():  # a pool that leaves the process group to the test
        init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    if dist.get_rank() == 1:
        raise ZeroDivisionError("rank one divided by zero")
    dist.recv(torch.zeros(1), src=1)  # never sent: only being stopped ends it


def _die_on_rank_zero():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def test_results_come_back_per_rank(capsys):
    assert run_distributed(_rank_and_sum, 2, 10) == [(0, 1.0), (10, 1.0)]
    assert "[rank 1] hello from 1" in capsys.readouterr().out


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    err = info.value
    assert [(f.rank, f.kind) for f in err.failures] == [(1, "raised")]
    assert "ZeroDivisionError: rank one divided by zero" in str(err)
    assert "_fail_on_rank_one" in err.failures[0].detail
    # the broken pool was replaced: the next call works
    assert run_distributed(_rank_and_sum, 2, 1) == [(0, 1.0), (1, 1.0)]


@pytest.mark.parametrize("init_process_group", [True, False])
def test_a_raising_rank_stops_the_others_at_once_and_is_reported_first(init_process_group):
    """As torchrun stops a job's other workers: before, rank 0 waited out a 10 s grace in its recv."""
    run_distributed(_rank_and_sum, 2, 1, init_process_group=init_process_group)  # a warm pool: time the failure
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_one_while_zero_receives, 2, timeout=120, init_process_group=init_process_group)
    assert time.monotonic() - start < 5
    first, second = info.value.failures
    assert (first.rank, first.kind) == (1, "raised") and "ZeroDivisionError: rank one divided by zero" in first.detail
    # rank 0 is stopped in its recv, or raised from it (when rank 1's cleanup tore the test's group down)
    assert second.rank == 0 and second.kind in ("stopped", "raised") and "recv" in second.detail
    # and its report names rank 1's error, not only where rank 0 was
    assert "after rank 1 raised ZeroDivisionError: rank one divided by zero" in second.detail.splitlines()[0]
    assert "failed in _raise_on_one_while_zero_receives: rank 1 raised, rank 0 " in str(info.value)
    assert run_distributed(_rank_and_sum, 2, 1, init_process_group=init_process_group) == [(0, 1.0), (1, 1.0)]


def test_a_hanging_rank_times_out_with_every_stack():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank_one, 2, timeout=3)
    assert time.monotonic() - start < 30
    kinds = {f.rank: f.kind for f in info.value.failures}
    assert kinds == {0: "timed out", 1: "timed out"}
    stacks = {f.rank: f.detail for f in info.value.failures}
    assert "_hang_on_rank_one" in stacks[1] and "time.sleep" not in stacks[0]
    assert "barrier" in stacks[0]


def test_a_dying_rank_is_reported():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_die_on_rank_zero, 2, timeout=20)
    failures = {f.rank: f for f in info.value.failures}
    assert failures[0].kind == "died" and "exited with code 3" in failures[0].detail
    # rank 1's gloo error ("Connection reset by peer") comes with its cause: rank 0's death, reported first
    assert info.value.failures[0].rank == 0
    assert failures[1].detail.startswith("after rank 0 died (the process exited with code 3)"), failures[1].detail


def test_local_functions_are_refused_with_a_fix():
    def local():
        return 1

    with pytest.raises(TypeError, match="define it at module level"):
        run_distributed(local, 2)


@pytest.mark.parametrize("n", [1, 3])
@distributed(world_size=2)
def test_decorator_passes_parameters(n):
    t = torch.full((1,), float(n))
    dist.all_reduce(t)
    assert t.item() == 2 * n


def _warn_on_rank_one() -> None:
    if dist.get_rank() == 1:
        warnings.warn("old name: use the new one", DeprecationWarning, stacklevel=1)


def test_a_rank_warning_is_raised_again_in_the_test():
    """pytest's filters (``filterwarnings = error::DeprecationWarning``) see what the ranks raise."""
    with pytest.warns(DeprecationWarning, match="old name: use the new one"):
        run_distributed(_warn_on_rank_one, 2)
    with pytest.raises(DeprecationWarning, match="old name"), warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        run_distributed(_warn_on_rank_one, 2)


def _make_groups(count):
    from ndweave.mesh.torch_compat import live_groups

    before = len(live_groups())
    for _ in range(count):
        dist.all_reduce(torch.ones(1), group=dist.new_group([0, 1]))
    return os.getpid(), before


def _state(pid: int) -> str:
    """The process's state letter, once it is stopped ("T") or after a second (a signal lands a moment
    after it is sent)."""
    deadline = time.monotonic() + 1.0
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        if state == "T" or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_a_pool_is_stopped_between_its_tasks_and_started_afresh_past_its_groups():
    """Every gloo group keeps a thread that wakes every few milliseconds: idle ranks are stopped
    (their threads poll nothing while the test or another pool works), and a pool holding more than
    MAX_GROUPS groups starts afresh before its next task."""
    from ndweave.mesh.testing import shutdown_pools
    from ndweave.mesh.testing.pool import MAX_GROUPS

    shutdown_pools()  # whatever earlier tests left in the pool, this one counts from a fresh start
    first = run_distributed(_make_groups, 2, 3)
    assert [before for _, before in first] == [1, 1]
    assert [_state(pid) for pid, _ in first] == ["T", "T"]  # stopped (SIGSTOP) until the next task
    second = run_distributed(_make_groups, 2, MAX_GROUPS)  # continued for it; ends past the bound
    assert [pid for pid, _ in second] == [pid for pid, _ in first]
    assert [before for _, before in second] == [before + 3 for _, before in first]
    third = run_distributed(_make_groups, 2, 0)
    assert not {pid for pid, _ in third} & {pid for pid, _ in first}  # new ranks
    assert [before for _, before in third] == [1, 1]  # the default group alone
