"""``ndweave.optim.cost`` predicts, from the bucket layout alone, the master and state bytes a
``DistributedOptimizer`` allocates on each rank (exactly: an estimate cannot drift from them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh.testing import distributed
from ndweave.optim import DistributedOptimizer
from ndweave.optim.cost import owned_elements, state_bytes_per_rank, state_values_per_element

from optim_common import dp_setup, train


def test_owned_elements_skip_padding_and_split_params():
    entries = [(0, 10), (10, 3)]  # 13 param elements in a bucket of 16 (3 of padding)
    assert [owned_elements(16, entries, 4, r) for r in range(4)] == [[4], [4], [2, 2], [1]]
    assert owned_elements(16, entries, 1, 0) == [10, 3]


def test_state_values_per_element_by_optimizer():
    assert state_values_per_element(torch.optim.AdamW, torch.float32) == (2 * 4, 4)  # exp_avg(_sq); step
    assert state_values_per_element(torch.optim.SGD, torch.float64, {"lr": 0.1, "momentum": 0.9}) == (8, 0)
    assert state_values_per_element(torch.optim.SGD, torch.float32, {"lr": 0.1}) == (0, 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@distributed(world_size=4, timeout=60)
def test_predicted_bytes_are_what_is_allocated(dtype):
    _, ddp = dp_setup(dtype=dtype)
    opt = DistributedOptimizer(torch.optim.AdamW, [ddp], optimizer_kwargs={"lr": 1e-3})
    train(ddp, opt, 1, dist.get_rank(), 4, dtype=dtype)
    layout = [(b.grad_data.numel(), [(p.offset, p.numel) for p in b.params]) for b in ddp.grad_buckets()]
    predicted = state_bytes_per_rank(layout, data_parallel_size=4, dp_rank=dist.get_rank(), param_dtype=dtype,
                                     optimizer=torch.optim.AdamW)
    assert predicted.state == opt.optimizer_state_bytes()
    assert predicted.masters == opt.master_param_bytes()
    assert (predicted.masters > 0) == (dtype == torch.bfloat16)
