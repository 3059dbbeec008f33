"""The data-position policy: resume by global sample index. The global batches after a resume are the
uninterrupted run's, whatever the data-parallel size before and after; the position is one number
that round-trips through a checkpoint; sizes that cannot split are refused with the fix."""

from __future__ import annotations

import itertools

import pytest

from ndweave.checkpoint import DataPosition, PositionSampler, load, rank_slice, save

DATASET, GLOBAL_BATCH = 10, 4  # batches straddle epochs: 10 is not a multiple of 4


def _global_batches(position: DataPosition, dp_size: int, steps: int, shuffle: bool = True) -> list[list[int]]:
    """What the DP ranks train on, step after step, advancing the position as a training loop does."""
    samplers = [iter(PositionSampler(DATASET, position, GLOBAL_BATCH, r, dp_size, shuffle=shuffle, seed=3))
                for r in range(dp_size)]
    batches = []
    for _ in range(steps):
        batches.append([i for s in samplers for i in itertools.islice(s, GLOBAL_BATCH // dp_size)])
        position.advance(GLOBAL_BATCH)
    return batches


def test_resuming_at_another_dp_size_continues_the_same_global_batches(tmp_path):
    uninterrupted = _global_batches(DataPosition(), dp_size=2, steps=7)
    assert len({i for b in uninterrupted[:2] for i in b}) == 8  # an epoch is a permutation
    assert sorted(uninterrupted[0] + uninterrupted[1] + uninterrupted[2][:2]) == list(range(DATASET))

    position = DataPosition()
    first = _global_batches(position, dp_size=2, steps=3)
    save(tmp_path / "ckpt", {"data": position})
    for dp_size in (1, 4):
        resumed = DataPosition()
        load(tmp_path / "ckpt", {"data": resumed})
        assert resumed.samples_seen == 3 * GLOBAL_BATCH and resumed.epoch(DATASET) == 1
        assert first + _global_batches(resumed, dp_size, steps=4) == uninterrupted


def test_rank_slices_partition_the_global_batch():
    assert [rank_slice(12, r, 3) for r in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    position = DataPosition(samples_seen=24)
    assert position.rank_slice(12, 2, 3) == slice(32, 36)
    in_order = PositionSampler(DATASET, position, GLOBAL_BATCH, 1, 2)
    assert list(itertools.islice(iter(in_order), 4)) == [6, 7, 0, 1]  # stream 26, 27, then 30, 31 (next epoch)


def test_sizes_that_cannot_split_name_the_fix():
    with pytest.raises(ValueError, match="divisible by 3"):
        rank_slice(10, 0, 3)
    with pytest.raises(ValueError, match="outside"):
        rank_slice(8, 4, 4)
    with pytest.raises(ValueError, match="cannot advance"):
        DataPosition().advance(-1)
