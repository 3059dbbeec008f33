"""Flat collectives as DDP and the sharded optimizer use them: in place, over a bucket."""

import torch
import torch.distributed as dist

from ndweave.mesh.collectives import all_gather_flat, reduce_scatter_flat
from ndweave.mesh.contracts import shard_range
from ndweave.mesh.testing import distributed


@distributed(world_size=4)
def test_reduce_scatter_then_all_gather_in_place():
    rank, world = dist.get_rank(), dist.get_world_size()
    bucket = torch.arange(8, dtype=torch.float32) * (rank + 1)  # sum over ranks: arange * 10
    start, end = shard_range(bucket.numel(), world, rank)
    reduce_scatter_flat(bucket[start:end], bucket, async_op=True).wait()
    assert torch.equal(bucket[start:end], torch.arange(start, end, dtype=torch.float32) * 10)
    bucket[start:end] += 1  # "the optimizer step" on this rank's range
    all_gather_flat(bucket, bucket[start:end])
    assert torch.equal(bucket, torch.arange(8, dtype=torch.float32) * 10 + 1)
