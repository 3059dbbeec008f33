"""The optimizer state format in mesh's contracts: sharded dicts of any layout merge into the full
form, any destination range resolves from either form, and the torch format round-trips."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from ndweave.mesh.contracts import (
    MASTER_KEY,
    ShardLayout,
    from_torch_state_dict,
    is_elementwise,
    merge_state_dicts,
    resolve_state_value,
    slice_piece,
    to_torch_state_dict,
    union_state_dicts,
)
from ndweave.mesh.torch_compat import StridedShard

FULL = {"w": torch.arange(24.0).reshape(4, 6), "b": torch.arange(6.0) + 100}
GROUPS = [{"lr": 0.1, "params": ["w", "b"]}]


def _rank_state(rank: int) -> dict:
    """Rank ``rank`` of TP=2 (w Shard(0), b StridedShard(0, 3)) x DP=2: each local tensor halved."""
    tp, dp = divmod(rank, 2)
    state = {}
    for fqn, placement in (("w", Shard(0)), ("b", StridedShard(0, split_factor=3))):
        layout = ShardLayout.from_placements(FULL[fqn].shape, (2,), [placement], (tp,))
        half = layout.numel // 2
        start, end = (0, half) if dp == 0 else (half, layout.numel)
        entry = {key: slice_piece(FULL[fqn] * scale, layout, start, end, fqn=fqn)
                 for key, scale in ((MASTER_KEY, 1.0), ("exp_avg", 2.0))}
        state[fqn] = {**entry, "step": torch.tensor(3.0)}
    return {"param_groups": GROUPS, "state": state}


def test_sharded_state_of_every_rank_merges_and_resolves_for_another_layout():
    ranks = [_rank_state(r) for r in range(4)]
    full = merge_state_dicts(ranks)
    for fqn, tensor in FULL.items():
        assert torch.equal(full["state"][fqn][MASTER_KEY], tensor)
        assert torch.equal(full["state"][fqn]["exp_avg"], 2 * tensor)
        assert float(full["state"][fqn]["step"]) == 3
    union = union_state_dicts(ranks)
    assert len(union["state"]["w"]["exp_avg"]) == 4
    # destination: w Shard(1) over TP=3, rank 2, elements 1..6 of its (4, 2) local tensor
    layout = ShardLayout.from_placements((4, 6), (3,), [Shard(1)], (2,))
    expected = (2 * FULL["w"])[:, 4:].reshape(-1)[1:7]
    for source in (union, full):
        value, elementwise = resolve_state_value(source["state"]["w"]["exp_avg"], "exp_avg", "w", layout, 1, 7)
        assert elementwise and torch.equal(value, expected)
        step, elementwise = resolve_state_value(source["state"]["w"]["step"], "step", "w", layout, 1, 7)
        assert not elementwise and float(step) == 3


def test_elementwise_rule_keeps_step_a_scalar_even_for_a_scalar_param():
    assert is_elementwise("exp_avg", torch.zeros(()), ())
    assert not is_elementwise("step", torch.zeros(()), ())
    assert not is_elementwise("exp_avg", torch.zeros(3), (4,)) and not is_elementwise("lr", 0.1, ())


def test_torch_format_round_trip():
    full = merge_state_dicts([_rank_state(r) for r in range(4)])
    torch_state = to_torch_state_dict(full)
    assert torch_state["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert MASTER_KEY not in torch_state["state"][0] and torch.equal(torch_state["state"][1]["exp_avg"], 2 * FULL["b"])
    back = from_torch_state_dict(torch_state, [["w", "b"]], params={k: v.double() for k, v in FULL.items()})
    assert back["param_groups"] == GROUPS
    assert back["state"]["w"][MASTER_KEY].dtype == torch.float64  # at least fp32: float64 stays
    with pytest.raises(ValueError, match="a group of 2 params was given 1 names"):
        from_torch_state_dict(torch_state, [["w"]])
