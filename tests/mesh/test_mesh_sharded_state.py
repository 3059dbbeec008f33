"""FlatShards: a (TP x DP)-sharded state tensor reassembles to the global one and re-slices from it."""

import pytest
import torch

from ndweave.mesh.contracts import FlatShard, merge_flat_shards, slice_flat_shard


def _shards(full: torch.Tensor, tp: int, dp: int) -> list[FlatShard]:
    """Row-shard ``full`` over TP, then cut each local tensor's flat range over DP (ignoring rows)."""
    rows = full.shape[0] // tp
    out = []
    for t in range(tp):
        shape, offset = (rows, full.shape[1]), (t * rows, 0)
        numel = rows * full.shape[1]
        for d in range(dp):
            start, end = d * numel // dp, (d + 1) * numel // dp
            out.append(FlatShard("w", slice_flat_shard(full, start, end, shape, offset), start, end,
                                 shape, tuple(full.shape), offset))
    return out


@pytest.mark.parametrize("tp,dp", [(1, 1), (1, 3), (2, 2), (4, 3)])
def test_merge_inverts_slice(tp, dp):
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    shards = _shards(full, tp, dp)
    assert torch.equal(merge_flat_shards(shards), full)
    # TP replicas repeat shards: still the same tensor
    assert torch.equal(merge_flat_shards(shards + shards[:1]), full)


def test_missing_elements_and_mixed_params_are_errors():
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    shards = _shards(full, 2, 2)
    with pytest.raises(ValueError, match="leave 3 of 12 elements uncovered"):
        merge_flat_shards(shards[1:])
    other = FlatShard("b", torch.zeros(3), 0, 3, (3,), (3,), (0,))
    with pytest.raises(ValueError, match="cannot merge"):
        merge_flat_shards([shards[0], other])
