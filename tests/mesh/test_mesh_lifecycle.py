"""A job's bounds (``ndweave.mesh.lifecycle``): meshes get a finite collective timeout without being
asked, side groups inherit it, ``shutdown()`` tears everything down and names the ranks that did not
come or failed, and a device this process lacks is refused with the fix."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh import ShutdownError, init_device_mesh, init_mesh_from_spec, shutdown
from ndweave.mesh.lifecycle import (DEFAULT_TIMEOUT, announce_failure, destroy_side_group, failed_ranks,
                                    new_side_group, side_group)
from ndweave.mesh.mesh_args import check_device_type
from ndweave.mesh.testing import distributed
from ndweave.mesh.torch_compat import group_timeout, live_groups

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@distributed(world_size=4)
def test_a_mesh_bounds_its_groups_with_the_default_timeout_and_side_groups_inherit_it():
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("PP", "DP", "TP"))
    flat = mesh.flatten(("PP", "DP"), "PPDP")  # a group of its own (flattening every dim would be the world)
    for group in (mesh.get_group("DP"), mesh.get_group("TP"), flat.get_group()):
        assert group_timeout(group) == DEFAULT_TIMEOUT == timedelta(seconds=300)
    assert group_timeout(dist.group.WORLD) == timedelta(seconds=180)  # made by the harness: its own is kept
    checks = side_group(mesh.get_group("DP"), "test-checks")
    assert checks.group_desc == f"ndweave:test-checks:{mesh.get_group('DP').group_name}"
    assert group_timeout(checks) == DEFAULT_TIMEOUT and dist.get_backend(checks) == "gloo"
    assert side_group(mesh.get_group("DP"), "test-checks") is checks  # made once, found again
    tight = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"), timeout=7)
    assert group_timeout(tight.get_group("TP")) == timedelta(seconds=7)
    assert group_timeout(side_group(tight.get_group("TP"), "test-checks")) == timedelta(seconds=7)


@distributed(world_size=2, init_process_group=False)
def test_shutdown_lets_the_work_in_flight_finish_and_destroys_every_group():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    assert group_timeout(dist.group.WORLD) == DEFAULT_TIMEOUT  # the default group it made, too
    side = side_group(mesh.get_group("DP"), "test-checks")
    works = [dist.all_reduce(torch.ones(1000), group=side, async_op=True) for _ in range(20)]
    del works  # dropped un-waited: shutdown waits for them
    shutdown()
    assert not dist.is_initialized()
    shutdown()  # no group left: nothing to do


@distributed(world_size=2, init_process_group=False, timeout=60)
def test_a_rank_that_never_comes_is_named_on_the_ranks_that_did():
    init_device_mesh("cpu", (2,), mesh_dim_names=("DP",), timeout=2)
    if dist.get_rank() == 1:
        time.sleep(3)  # stuck elsewhere
        shutdown(abort=True)
        return
    begin = time.monotonic()
    with pytest.raises(ShutdownError, match=r"ranks \[1\] did not reach shutdown\(\) within 0:00:02") as raised:
        shutdown(timeout=2)
    assert raised.value.missing == [1] and not dist.is_initialized()
    assert time.monotonic() - begin < 10


@distributed(world_size=2, init_process_group=False, timeout=60)
def test_a_rank_that_failed_tells_the_others_why_at_once():
    init_device_mesh("cpu", (2,), mesh_dim_names=("DP",), timeout=30)
    begin = time.monotonic()
    if dist.get_rank() == 1:
        try:
            raise ZeroDivisionError("loss scale underflow")
        except ZeroDivisionError:
            shutdown(abort=True)
        assert not dist.is_initialized()
        return
    with pytest.raises(ShutdownError, match="rank 1 failed: ZeroDivisionError: loss scale underflow") as raised:
        shutdown()
    assert raised.value.failed == {1: "ZeroDivisionError: loss scale underflow"}
    assert time.monotonic() - begin < 10  # not the 60 s the barrier would wait for a missing rank



@distributed(world_size=3, init_process_group=False, timeout=60)
def test_a_failure_announced_outside_shutdown_ends_the_others_wait_at_once():
    """Rank 1 announces its error (what ndweave's checks do when they give up) and stays away; rank 2
    never comes either: rank 0 names rank 1's error in well under its 30 s wait for rank 2."""
    init_device_mesh("cpu", (3,), mesh_dim_names=("DP",), timeout=30)
    begin = time.monotonic()
    if dist.get_rank() == 0:
        with pytest.raises(ShutdownError, match=r"rank 1 failed: GradSyncDivergedError: rank 1 stepped alone; "
                                                r"ranks \[2\] did not reach shutdown\(\)") as raised:
            shutdown(timeout=30)
        assert raised.value.failed == {1: "GradSyncDivergedError: rank 1 stepped alone"}
        assert time.monotonic() - begin < 5
        return
    if dist.get_rank() == 1:
        announce_failure("GradSyncDivergedError: rank 1 stepped alone")
        assert failed_ranks([0, 1, 2]) == {1: "GradSyncDivergedError: rank 1 stepped alone"}
    time.sleep(3)  # elsewhere, until rank 0 has given up
    shutdown(abort=True)


def test_a_device_this_process_lacks_is_refused_with_the_fix():
    assert check_device_type("cpu") == "cpu"
    with pytest.raises(ValueError, match="'tpu' is not a device type torch knows"):
        check_device_type("tpu")
    with pytest.raises(TypeError, match="device type such as 'cpu'"):
        check_device_type(None)


def _cuda_mesh(how: str) -> str:
    with pytest.raises(ValueError) as raised:
        if how == "spec":
            init_mesh_from_spec("cuda", "dp=2")
        else:
            init_device_mesh("cuda", (2,), mesh_dim_names=("DP",))
    return str(raised.value)


@no_cuda
@pytest.mark.parametrize("how", ["mesh", "spec"])
def test_cuda_without_gpus_names_the_fix_with_or_without_a_process_group(how):
    """Before: with a group made, AttributeError '_cuda_setDevice' from deep inside DeviceMesh; without,
    "Distributed package doesn't have NCCL built in"."""
    from ndweave.mesh.testing import run_distributed

    for init_process_group in (True, False):
        messages = run_distributed(_cuda_mesh, 2, how, init_process_group=init_process_group, timeout=60)
        for message in messages:
            assert "this process sees no cuda device" in message and "Pass 'cpu'" in message


# ---------------------------------------------------------------------- side groups
@distributed(world_size=4)
def test_every_side_group_gets_the_library_timeout_and_a_tag():
    rank = dist.get_rank()
    checks = new_side_group(range(4), desc="test-checks")
    assert checks.group_desc == "ndweave:test-checks" and dist.get_backend(checks) == "gloo"
    assert group_timeout(checks) == DEFAULT_TIMEOUT  # never torch's 30 minutes
    tight = new_side_group([0, 1, 2, 3], desc="test-tight", timeout=7)
    assert group_timeout(tight) == timedelta(seconds=7)
    if rank in (1, 3):  # made by its ranks alone: 0 and 2 never call it
        pair = new_side_group([3, 1], desc="test-pair", timeout=timedelta(seconds=5))
        assert dist.get_process_group_ranks(pair) == [1, 3] and group_timeout(pair) == timedelta(seconds=5)
        total = torch.ones(1)
        dist.all_reduce(total, group=pair)
        assert total.item() == 2
    dist.barrier()


@distributed(world_size=2)
def test_a_destroyed_side_group_leaves_no_name_for_the_next_one_to_collide_with():
    count = len(live_groups())
    first = new_side_group([0, 1], desc="test-owned")
    later = new_side_group([0, 1], desc="test-later")  # made after it, over the same ranks
    destroy_side_group(first)
    assert first not in live_groups() and len(live_groups()) == count + 2  # a one-rank group holds its place
    again = new_side_group([0, 1], desc="test-again")  # would take `later`'s name without the placeholder
    assert again.group_name not in (first.group_name, later.group_name)
    for group in (later, again):
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        assert total.item() == 2


# ---------------------------------------------------------------------- shutdown(*closeables)
class _Closeable:
    def __init__(self, name: str, closed: list[str], error: Exception | None = None) -> None:
        self.name, self.closed, self.error = name, closed, error

    def close(self) -> None:
        self.closed.append(self.name)
        if self.error is not None:
            raise self.error


def test_shutdown_closes_what_it_is_given_in_order_even_without_a_process_group():
    closed: list[str] = []
    shutdown(_Closeable("manager", closed), _Closeable("model", closed))
    assert closed == ["manager", "model"]
    with pytest.raises(TypeError, match=r"needs a close\(\) method; got a str"):
        shutdown("model")
    closed.clear()
    with pytest.raises(ShutdownError, match=r"shutdown\(\) on rank 0: _Closeable.close\(\) failed: OSError: disk full$") as raised:
        shutdown(_Closeable("manager", closed, OSError("disk full")), _Closeable("model", closed))
    assert closed == ["manager", "model"]  # a failed close does not stop the others
    assert isinstance(raised.value.__cause__, OSError) and raised.value.failed == {0: "_Closeable.close() failed: OSError: disk full"}


@distributed(world_size=2, init_process_group=False, timeout=60)
def test_objects_are_closed_before_the_groups_go_and_a_failed_close_is_named_on_every_rank():
    init_device_mesh("cpu", (2,), mesh_dim_names=("DP",), timeout=30)
    closed: list[str] = []

    class Pending:  # an async save that still needs its group when closed
        def __init__(self) -> None:
            self.group = new_side_group([0, 1], desc="test-pending")

        def close(self) -> None:
            total = torch.ones(1)
            dist.all_reduce(total, group=self.group)
            closed.append(f"pending:{int(total.item())}")

    begin = time.monotonic()
    if dist.get_rank() == 1:
        with pytest.raises(ShutdownError, match=r"shutdown\(\) on rank 1: _Closeable.close\(\) failed: ValueError: bad"):
            shutdown(Pending(), _Closeable("model", closed, ValueError("bad")))
    else:
        with pytest.raises(ShutdownError, match=r"rank 1 failed: _Closeable.close\(\) failed: ValueError: bad") as raised:
            shutdown(Pending(), _Closeable("model", closed))
        assert raised.value.failed == {1: "_Closeable.close() failed: ValueError: bad"}
    assert closed == ["pending:2", "model"] and not dist.is_initialized()
    assert time.monotonic() - begin < 10


@distributed(world_size=2, init_process_group=False, timeout=60)
def test_shutdown_with_abort_warns_of_a_failed_close_and_reports_the_error_in_flight():
    init_device_mesh("cpu", (2,), mesh_dim_names=("DP",), timeout=30)
    if dist.get_rank() == 1:
        try:
            raise ZeroDivisionError("loss scale underflow")
        except ZeroDivisionError:
            with pytest.warns(RuntimeWarning, match=r"shutdown\(abort=True\): _Closeable.close\(\) failed: OSError: gone"):
                shutdown(_Closeable("model", [], OSError("gone")), abort=True)
        return
    with pytest.raises(ShutdownError, match="rank 1 failed: ZeroDivisionError: loss scale underflow"):
        shutdown()
