"""The data-parallel contract's shared pieces: the bucket layout rules, the tied-replica mark, the
reference wrapper (which must pass ``check_data_parallel``) and the check itself, which must fail
wrappers that break the contract."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from ndweave.mesh import init_device_mesh
from ndweave.mesh.contracts import (
    BUCKET_ALIGNMENT,
    BucketParam,
    DataParallelWrapper,
    GradBucket,
    is_tied_replica,
    mark_tied_replica,
    padded_bucket_numel,
    slot_numel,
    tied_primary,
    uses_distributed_optimizer,
)
from ndweave.mesh.testing import ReferenceDataParallel, check_data_parallel, distributed
from ndweave.mesh.torch_compat import flatten_mesh


# ---------------------------------------------------------------------- layout rules
def test_buckets_pad_to_a_multiple_of_dp_size_times_the_alignment():
    assert BUCKET_ALIGNMENT == 64
    assert padded_bucket_numel(0, 4) == 0
    assert padded_bucket_numel(1, 4) == 256
    assert padded_bucket_numel(256, 4) == 256
    assert padded_bucket_numel(257, 2) == 384
    assert padded_bucket_numel(10, 3, alignment=1) == 12


@distributed(world_size=2)
def test_an_uneven_shard_reserves_its_largest_peers_size():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    weight = distribute_tensor(torch.ones(7, 3), mesh["TP"], [Shard(0)])  # 4 rows on rank 0, 3 on rank 1
    assert weight.to_local().shape[0] == (4 if dist.get_rank() == 0 else 3)
    assert slot_numel(weight) == 12  # on both ranks, so their bucket layouts agree
    assert slot_numel(torch.ones(7, 3)) == 21


def test_tied_replica_mark():
    embedding, head = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    assert mark_tied_replica(head) is head
    assert is_tied_replica(head) and not is_tied_replica(embedding)
    assert tied_primary(head) is None and tied_primary(embedding) is None
    other = mark_tied_replica(torch.nn.Parameter(torch.ones(2)), primary="transformer.wte.weight")
    assert is_tied_replica(other) and tied_primary(other) == "transformer.wte.weight"
    with pytest.raises(TypeError, match="parameter"):
        mark_tied_replica("lm_head.weight")
    with pytest.raises(TypeError, match="FQN"):
        mark_tied_replica(head, primary=0)


def test_sharded_layout_is_read_from_the_buckets():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    sharded = ReferenceDataParallel(model, None, bucket_size=1, use_distributed_optimizer=True)
    assert isinstance(sharded, DataParallelWrapper) and uses_distributed_optimizer(sharded)
    assert all(b.param_data is not None for b in sharded.grad_buckets()) and len(sharded.grad_buckets()) == 4
    plain = ReferenceDataParallel(torch.nn.Linear(3, 4), None)
    assert not uses_distributed_optimizer(plain)
    first = sharded.grad_buckets()[0]
    sharded._buckets[0] = GradBucket(first.params, first.grad_data, None, None)
    with pytest.raises(ValueError, match="with and without param_data"):
        uses_distributed_optimizer(sharded)


# ---------------------------------------------------------------------- the reference passes
@pytest.mark.parity
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@pytest.mark.parametrize("grad_reduction", ["mean", "sum"])
@distributed(world_size=4)
def test_reference_meets_the_contract(use_distributed_optimizer, grad_reduction):
    check_data_parallel(
        lambda module, dp_mesh: ReferenceDataParallel(module, dp_mesh, bucket_size=16, grad_reduction=grad_reduction,
                                                      use_distributed_optimizer=use_distributed_optimizer),
        tensor_parallel_size=2,
    )


@pytest.mark.parity
@distributed(world_size=1)
def test_reference_meets_the_contract_on_one_rank():
    check_data_parallel(lambda module, dp_mesh: ReferenceDataParallel(module, dp_mesh, use_distributed_optimizer=True))


# ---------------------------------------------------------------------- the check can fail
class _MislabelsReduction(ReferenceDataParallel):
    @property
    def grad_reduction(self):
        return "sum" if self._grad_reduction == "mean" else "mean"


class _DropsNoSyncGrads(ReferenceDataParallel):
    def no_sync(self):
        outer = super().no_sync()

        class _Dropping:
            def __enter__(inner):
                outer.__enter__()

            def __exit__(inner, *exc):
                for bucket in self.grad_buckets():
                    for bp in bucket.params:
                        bp.param.grad = None  # the accumulated micro-batches are lost
                return outer.__exit__(*exc)

        return _Dropping()


class _ReducesAgain(ReferenceDataParallel):
    def finish_grad_sync(self):
        self._synced = False  # forgets the step was synced: a sum is summed again
        super().finish_grad_sync()


class _KeepsStaleBuffers(ReferenceDataParallel):
    def zero_grad_buffer(self):
        for bucket in self.grad_buckets():
            for bp in bucket.params:
                bp.param.grad = None
        self._synced = False


class _CopiesParams(ReferenceDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.module.parameters():
            p.data = p.data.clone()  # param_data no longer is the params


class _UnpaddedBuckets(ReferenceDataParallel):
    def _build_bucket(self, chunk, grad_dtype):
        bucket = super()._build_bucket(chunk, grad_dtype)
        used = max(bp.offset + bp.numel for bp in bucket.params)
        used += 1 - used % 2  # odd: no longer divisible by DP=2
        return GradBucket(bucket.params, bucket.grad_data[:used], None, bucket.data_parallel_group)


class _IgnoresPeerShards(ReferenceDataParallel):
    def _build_bucket(self, chunk, grad_dtype):
        bucket = super()._build_bucket(chunk, grad_dtype)
        params, offset = [], 0
        for bp in bucket.params:  # packed by local numel: TP peers with uneven shards disagree
            params.append(BucketParam(bp.name, bp.param, offset, bp.numel))
            offset += bp.numel
        grad_data = bucket.grad_data.new_zeros(padded_bucket_numel(offset, self.data_parallel_size))
        return GradBucket(tuple(params), grad_data, None, bucket.data_parallel_group)


BROKEN = {
    "mislabelled reduction": (_MislabelsReduction, {}, "grad_reduction is 'sum' but the synced grads are the mean"),
    "no_sync drops grads": (_DropsNoSyncGrads, {}, r"no_sync\(\)"),
    "finish twice reduces twice": (_ReducesAgain, {"grad_reduction": "sum"}, "a second finish_grad_sync"),
    "zero_grad_buffer keeps grads": (_KeepsStaleBuffers, {}, r"zero_grad_buffer\(\) left"),
    "params are not param_data": (_CopiesParams, {"use_distributed_optimizer": True}, "is not the param_data view"),
    "unpadded buckets": (_UnpaddedBuckets, {}, "divisible by the DP size"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
@distributed(world_size=2)
def test_the_check_fails_a_broken_wrapper(broken):
    cls, kwargs, message = BROKEN[broken]
    with pytest.raises(AssertionError, match=message):
        check_data_parallel(lambda module, dp_mesh: cls(module, dp_mesh, bucket_size=16, **kwargs))


@distributed(world_size=4)
def test_the_check_fails_a_wrapper_whose_tp_peers_disagree_on_the_layout():
    with pytest.raises(AssertionError, match="DTensor .TP. params:\n.*lay their buckets out differently"):
        check_data_parallel(lambda module, dp_mesh: _IgnoresPeerShards(module, dp_mesh, bucket_size=16),
                            tensor_parallel_size=2)


class _ClaimsTheWorld(ReferenceDataParallel):
    def _build_bucket(self, chunk, grad_dtype):
        bucket = super()._build_bucket(chunk, grad_dtype)  # labelled with the world, outside the DP mesh
        return GradBucket(bucket.params, bucket.grad_data, bucket.param_data, dist.group.WORLD)


@distributed(world_size=4)
def test_the_check_fails_a_bucket_reduced_outside_the_data_parallel_mesh():
    with pytest.raises(AssertionError, match=r"DTensor .TP. params:\n.*reduced over ranks \[0, 1, 2, 3\], which is not"):
        check_data_parallel(lambda module, dp_mesh: _ClaimsTheWorld(module, dp_mesh, bucket_size=16),
                            tensor_parallel_size=2)


@distributed(world_size=4)
def test_the_check_fails_a_wrapper_that_reduces_ep_sharded_params_over_ep():
    # every grad over DP x EP: the EP ranks' different rows of the sharded weight get summed together
    def over_everything(module, data_mesh):
        return ReferenceDataParallel(module, flatten_mesh(data_mesh, "DP_EP"), bucket_size=16)

    with pytest.raises(AssertionError, match=r"params sharded over EP, no_sync\(\):\nrank 0: bucket 1 grad_data of 2.weight"):
        check_data_parallel(over_everything, expert_parallel_size=2)
