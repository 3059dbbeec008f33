"""Meshes for whatever world a job gets (``ndweave.mesh.spec``) and failing fast when a peer is lost
(``ndweave.mesh.elastic``): spec resolution and its errors, the collective timeout on a real rank
whose peer never joins, and the fresh store namespace a torchrun restart needs."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh import init_mesh_from_spec, parse_spec, resolve_spec
from ndweave.mesh.elastic import as_timedelta, fresh_namespace, lost_ranks
from ndweave.mesh.testing import distributed


def test_the_flexible_dim_takes_the_rest_of_the_world():
    assert resolve_spec("pp=2,dp=-1,tp=2", 16) == {"PP": 2, "DP": 4, "TP": 2}
    assert resolve_spec("pp=2,dp=-1,tp=2", 4) == {"PP": 2, "DP": 1, "TP": 2}
    assert resolve_spec({"tp": 2}, 2) == {"PP": 1, "DP": 1, "TP": 2}
    assert resolve_spec("dp=-1,tp=2", 8, allowed=[1, 2, 4]) == {"PP": 1, "DP": 4, "TP": 2}
    assert list(resolve_spec("cp=-1,tp=2", 8, dims=("DP", "CP", "TP"))) == ["DP", "CP", "TP"]  # dims' order
    assert parse_spec("TP=2, dp=-1") == {"PP": 1, "DP": -1, "TP": 2}
    assert resolve_spec("pp=2,tp=2", None) == {"PP": 2, "DP": 1, "TP": 2}  # nothing to infer


@pytest.mark.parametrize("spec, world, message", [
    ("tp=4,dp=-1", 6, "cannot run on 6 ranks: its fixed dims need a multiple of 4"),
    ("pp=2,dp=2,tp=2", 4, "needs 8 ranks but the world has 4"),
    ("dp=-1,tp=2", 8, None),
    ("dp=-1", None, "needs the world size"),
    ("cp=2", 2, "expected NAME=SIZE with NAME one of pp, dp, tp"),
    ("dp=-1,tp=-1", 4, "at most one dim may be -1"),
    ("tp=0", 1, "sizes must be positive"),
])
def test_a_world_that_cannot_host_the_spec_is_an_error_naming_both(spec, world, message):
    if message is None:  # a size the job cannot use
        with pytest.raises(ValueError, match=r"gives DP=4, not one of the allowed sizes \[1, 2\]; launch 2 or 4 ranks"):
            resolve_spec(spec, world, allowed=[1, 2])
        return
    with pytest.raises(ValueError, match=message):
        resolve_spec(spec, world)


def test_timeouts_are_seconds_or_timedeltas():
    assert as_timedelta(2.5) == timedelta(seconds=2.5) and as_timedelta(None) is None
    assert as_timedelta(timedelta(minutes=1)) == timedelta(seconds=60)
    with pytest.raises(ValueError, match="positive number of seconds"):
        as_timedelta(0)


@distributed(world_size=4, timeout=120)
def test_a_peer_that_never_joins_is_an_error_within_the_timeout():
    """Ranks 0 and 1 share a TP group with a 2 s timeout; rank 1 never joins rank 0's all-reduce."""
    mesh = init_mesh_from_spec("cpu", "dp=-1,tp=2", dims=("DP", "TP"), timeout=2)
    assert mesh.shape == (2, 2)
    if dist.get_rank() == 0:
        begin = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out"):
            dist.all_reduce(torch.ones(1), group=mesh.get_group("TP"))
        assert 1.5 < time.monotonic() - begin < 15, time.monotonic() - begin


@distributed(world_size=2, timeout=60)
def test_survivors_name_the_rank_that_did_not_report_in():
    if dist.get_rank() == 0:  # rank 1 plays the dead peer: it never reports
        assert lost_ranks(1.0) == [1]


def test_each_worker_group_gets_a_namespace_the_previous_one_never_wrote():
    """The torchrun restart trap: the store still holds the previous group's keys (its namespace and
    its welcomes). Rank 1 may read the old name first; both ranks must still agree on a new one."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    found: dict[int, str] = {}

    def join(rank: int) -> None:  # a client per rank, as each worker process has
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        found[rank] = fresh_namespace(client, rank, 3, timedelta(seconds=20))

    old = [threading.Thread(target=join, args=(r,)) for r in range(3)]
    for t in old:
        t.start()
    for t in old:
        t.join()
    assert len(set(found.values())) == 1
    stale, found = found[0], {}
    late = [threading.Thread(target=join, args=(r,)) for r in (1, 2)]  # they read the stale name first
    for t in late:
        t.start()
    time.sleep(0.3)
    join(0)
    for t in late:
        t.join()
    assert len(set(found.values())) == 1 and found[0] != stale, (found, stale)


def test_a_mesh_started_without_a_launcher_says_to_use_torchrun():
    """``init_device_mesh`` in a script run with plain ``python``: torch's env:// would say only
    "environment variable RANK expected"; the error names torchrun and the other way out."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                             "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    code = "from ndweave.mesh import init_device_mesh\ninit_device_mesh('cpu', (1,))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set. Start the script with torchrun" in out.stderr
