"""ndweave.mesh.agree: a check that fails or differs on one rank raises the same error on every rank,
over a whole nD mesh, a process group, or the default group; never a hang."""

import pytest
import torch.distributed as dist

from ndweave.mesh import init_device_mesh
from ndweave.mesh.agree import (RankMismatchError, agree_or_raise, decide_on_first, gather, gather_ints,
                                raise_on_every_rank)
from ndweave.mesh.testing import distributed


def _over(kind: str):
    if kind == "mesh":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    return dist.group.WORLD if kind == "group" else None


def _outcome(fn):
    """What the call raised on this rank, as (type name, message), or ("ok", its result)."""
    try:
        return "ok", fn()
    except Exception as error:  # noqa: BLE001 - compared across ranks by the test
        return type(error).__name__, str(error)


@pytest.mark.parametrize("kind", ["mesh", "group", "default"])
@distributed(world_size=4, timeout=60)
def test_agreement_passes_through_results_and_gathers_local_values(kind):
    over, rank = _over(kind), dist.get_rank()
    assert gather(over, rank * 10) == {0: 0, 1: 10, 2: 20, 3: 30}
    result, local = agree_or_raise(over, "the check", lambda: (rank, {"plan": "same", "local": rank + 100}))
    assert result == rank and local == {r: r + 100 for r in range(4)}


@pytest.mark.parametrize("kind", ["mesh", "group", "default"])
@distributed(world_size=4, timeout=60)
def test_a_rank_whose_check_fails_raises_its_error_on_every_rank(kind):
    over, rank = _over(kind), dist.get_rank()

    def check():
        if rank in (2, 3):
            raise TypeError(f"bad input on {rank}")
        return None, {}

    outcomes = gather(None, _outcome(lambda: agree_or_raise(over, "the check", check)))
    assert set(outcomes.values()) == {("TypeError", "the check failed on rank 2 (and ranks [3]): bad input on 2")}


@distributed(world_size=4, timeout=60)
def test_a_rank_given_another_value_is_named_with_the_entry_and_the_hint():
    rank = dist.get_rank()
    plan = {"fc1.weight": "Shard(0)", "fc2.weight": "Shard(1)" if rank != 3 else "Shard(0)"}
    outcomes = gather(None, _outcome(lambda: agree_or_raise(_over("mesh"), "parallelize_module",
                                                            lambda: (None, {"plan": plan}), hint="pass the same plan")))
    assert set(outcomes.values()) == {("RankMismatchError", "parallelize_module: rank 3 was given another plan than "
                                       "rank 0: 'fc2.weight' is Shard(1) on rank 0 but Shard(0) on rank 3; pass the same plan")}
    # equal values whose repr differs (dicts built in another order) agree
    order = ["a", "b"] if rank % 2 else ["b", "a"]
    agree_or_raise(None, "x", lambda: (None, {"d": {k: 1 for k in order}}))


@distributed(world_size=2, timeout=60)
def test_every_rank_problems_are_raised_together_on_every_rank():
    problems = [f"only rank {dist.get_rank()} sees this"] + ["both see this"]
    outcome = _outcome(lambda: raise_on_every_rank(None, "loading", problems, ValueError, "fix it"))
    assert outcome == ("ValueError", "loading:\n  rank 0: only rank 0 sees this\n  ranks 0, 1: both see this\n"
                                     "  rank 1: only rank 1 sees this\nfix it")
    raise_on_every_rank(None, "loading", [])  # nothing found: nothing raised


def test_without_a_process_group_the_calls_are_local():
    assert gather(None, 5) == {0: 5}
    assert agree_or_raise(None, "x", lambda: (1, {"local": 2})) == (1, {0: 2})
    with pytest.raises(RankMismatchError, match="loading:\n  rank 0: p"):
        raise_on_every_rank(None, "loading", ["p"])


def test_a_fake_world_has_no_other_rank_to_gather_from(monkeypatch):
    # fake_world is one process: no collective runs (the planner's traces agree on plans there)
    from ndweave.mesh import fake_world

    def no_collective(*args, **kwargs):
        raise AssertionError("all_gather_object ran in a fake world")

    monkeypatch.setattr(dist, "all_gather_object", no_collective)
    with fake_world(8, rank=3):
        assert gather(None, "x") == {3: "x"}
        mesh = init_device_mesh("cpu", (2, 4))
        assert agree_or_raise(mesh, "plan", lambda: (1, {"plan": "p", "local": 7})) == (1, {3: 7})


@pytest.mark.parametrize("kind", ["mesh", "group", "default"])
@distributed(world_size=4, timeout=60)
def test_a_few_ints_are_gathered_in_one_tensor_collective_per_group(kind):
    over, rank = _over(kind), dist.get_rank()

    def no_pickling(*args, **kwargs):
        raise AssertionError("all_gather_object ran")

    saved, dist.all_gather_object = dist.all_gather_object, no_pickling  # (on the rank: no monkeypatch there)
    try:
        assert gather_ints(over, [rank, 7, -rank]) == {r: (r, 7, -r) for r in range(4)}
    finally:
        dist.all_gather_object = saved


@distributed(world_size=4, timeout=60)
def test_the_first_rank_decides_each_ranks_answer_and_only_it_sees_every_value():
    rank, seen = dist.get_rank(), []

    def decide(everyone):
        seen.append(everyone)
        return {r: sum(everyone.values()) + r for r in everyone}

    assert decide_on_first(None, "planning", rank * 10, decide) == 60 + rank
    assert seen == ([{0: 0, 1: 10, 2: 20, 3: 30}] if rank == 0 else [])
    pair = dist.new_group([1, 3])
    if rank in (1, 3):  # the group's first rank (global rank 1) decides
        assert decide_on_first(pair, "x", rank, lambda everyone: {r: (dist.get_rank(), everyone) for r in everyone}) == \
            (1, {1: 1, 3: 3})

    def fails(everyone):
        raise ValueError("no plan for rank 9")

    outcome = _outcome(lambda: decide_on_first(None, "planning", rank, fails))
    assert outcome == ("ValueError", "planning failed on rank 0: no plan for rank 9")
    assert set(gather(None, outcome).values()) == {outcome}


@distributed(world_size=2, timeout=60)
def test_a_mismatch_can_be_phrased_by_the_caller():
    rank = dist.get_rank()
    outcome = _outcome(lambda: agree_or_raise(None, "wrap", lambda: (None, {"model": f"m{rank}", "local": rank}),
                                              mismatch=lambda everyone: ValueError(f"models {everyone}")))
    assert outcome == ("ValueError", "models {0: {'model': 'm0'}, 1: {'model': 'm1'}}")


def test_without_a_process_group_the_exchanges_are_local():
    assert gather_ints(None, [1, 2]) == {0: (1, 2)}
    assert decide_on_first(None, "x", 5, lambda everyone: {0: everyone[0] + 1}) == 6
