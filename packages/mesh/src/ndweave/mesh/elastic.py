"""Joining the process group under torch's elastic launcher, and failing fast when a peer is lost.

Two things torch leaves to the user, both needed for ``torchrun --max-restarts N`` to restart a job:

* **A fresh rendezvous per worker group.** torchrun (2.13) shares its agent's TCP store with the
  workers (``TORCHELASTIC_USE_AGENT_STORE=True``), and the store outlives a restart. The restarted
  workers find the previous group's keys in it, gloo reads the dead workers' addresses and fails with
  "Gloo connectFullMesh failed ... Connection refused". :func:`init_process_group` puts each worker
  group's keys under a prefix no earlier group wrote to (see :func:`fresh_namespace`).
* **A bounded wait.** :func:`as_timedelta` takes seconds or a ``timedelta``; ``init_device_mesh(...,
  timeout=)`` gives it to the default group and to every dim group of the mesh (300 s when none is
  given, ``ndweave.mesh.lifecycle.DEFAULT_TIMEOUT``), so a collective with a dead or stuck peer raises
  on every survivor within that time instead of torch's 30 minutes (gloo) / 10 minutes (NCCL).
  :func:`lost_ranks` then asks the store which ranks are gone.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from ndweave.mesh.lifecycle import as_timedelta, collective_timeout
from ndweave.mesh.torch_compat import default_store

__all__ = ["as_timedelta", "fresh_namespace", "init_process_group", "lost_ranks", "restart_count"]

# How long a non-zero rank waits for rank 0's welcome before it reads the namespace again: the value
# it read may have been the previous worker group's, written before this group's rank 0 got there.
_RETRY_S = 0.5


def restart_count() -> int:
    """How many times torchrun has restarted this node's workers (``TORCHELASTIC_RESTART_COUNT``; 0
    outside torchrun). Other nodes may count differently: a node restarted because another failed
    or joined does not count a restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_process_group(backend: str, timeout: timedelta | float | None = None) -> None:
    """``dist.init_process_group(backend, timeout=timeout)``, safe to call again after a torchrun restart.
    ``timeout`` ``None`` is ndweave's default (``lifecycle.DEFAULT_TIMEOUT``, 300 s), not torch's.

    Under torchrun with a shared agent store the group is built on a fresh namespace of that store;
    anywhere else it is torch's ``env://`` initialization unchanged."""
    timeout = collective_timeout(timeout)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:  # torch's env:// says only "environment variable RANK expected", not what to do
        raise RuntimeError(f"no process group and no launcher: {', '.join(missing)} not set. Start the script "
                           "with torchrun (torchrun --nproc-per-node N script.py, or python -m torch.distributed.run "
                           "...), or call torch.distributed.init_process_group yourself before building the mesh")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                is_master=False, timeout=timeout)
    namespace = fresh_namespace(agent_store, rank, world, timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(namespace, agent_store), rank=rank,
                            world_size=world, timeout=timeout)


def fresh_namespace(store: dist.Store, rank: int, world: int, timeout: timedelta) -> str:
    """A key prefix of ``store`` that no earlier worker group wrote to, the same on every rank.

    Rank 0 draws a random name and publishes it. A rank cannot tell that name from one the previous
    group's rank 0 left behind, so each other rank answers under the name it read with a random token
    of its own, and waits for rank 0 to welcome that token: rank 0 only answers under the new name, and
    no earlier process could have written a key holding a token drawn now. A rank that read an old
    name hears nothing within ``_RETRY_S`` and reads again. Needs every earlier worker group to be gone,
    which torchrun ensures before it starts the next one."""
    if rank == 0:
        namespace = f"ndweave/group/{uuid.uuid4().hex}/"
        store.set("ndweave/namespace", namespace)
        for peer in range(1, world):
            store.wait([f"{namespace}hello/{peer}"], timeout)
            token = store.get(f"{namespace}hello/{peer}").decode()
            store.set(f"{namespace}welcome/{token}", "1")
        return namespace
    token, deadline = uuid.uuid4().hex, time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        namespace = store.get("ndweave/namespace").decode()  # blocks until some rank 0 has written it
        store.set(f"{namespace}hello/{rank}", token)
        # polled, not store.wait: a timed-out wait logs a C++ warning on every retry
        retry = min(deadline, time.monotonic() + _RETRY_S)
        while time.monotonic() < retry:
            if store.check([f"{namespace}welcome/{token}"]):
                return namespace
            time.sleep(0.01)
    raise dist.DistStoreError(f"rank {rank} found no process group to join within {timeout}: rank 0 did not "
                              f"answer (is it alive, and is the world size {world} the same on every node?)")


def lost_ranks(wait: timedelta | float) -> list[int] | None:
    """After a collective failed: the ranks that did not also report in within ``wait`` (the peers
    that are gone, or stuck), through the default group's store. Every survivor should call it:
    each one reports itself. ``None`` when the store itself is unreachable (its host, rank 0's node, is gone).

    Call it with the process-group timeout: a survivor blocked in another collective needs that long
    to notice."""
    wait = as_timedelta(wait)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = default_store()
        store.set(f"ndweave/alive/{rank}", "1")
        missing, deadline = set(range(world)) - {rank}, time.monotonic() + wait.total_seconds()
        while missing and time.monotonic() < deadline:
            missing = {r for r in missing if not store.check([f"ndweave/alive/{r}"])}
            time.sleep(0.05)
    except dist.DistError:
        return None
    return sorted(missing)
