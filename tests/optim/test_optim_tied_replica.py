"""A weight tied across pipeline stages is counted once in the global grad norm: the stage holding
the second copy marks it with ``ndweave.mesh.contracts.mark_tied_replica``.

Two ranks stand in for two pipeline stages holding the same layer (its weight tied, its bias not):
the norm both optimizers compute over the world must count the weight's grad once, the bias twice.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ndweave.mesh.contracts import mark_tied_replica
from ndweave.mesh.testing import ReferenceDataParallel, assert_close, distributed, measured_tolerance
from ndweave.optim import BasicOptimizer, DistributedOptimizer


def _layer() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


@pytest.mark.kernels
@pytest.mark.parametrize("sharded", [False, True])
@distributed(world_size=2)
def test_a_marked_tied_weight_counts_once_in_the_global_grad_norm(sharded):
    layer = _layer()
    if dist.get_rank() == 1:  # the second stage holds the second copy
        mark_tied_replica(layer.weight)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    if sharded:  # no data parallelism: each "stage" is its own DP group of one
        model = ReferenceDataParallel(layer, None, use_distributed_optimizer=True)
        opt = DistributedOptimizer(torch.optim.SGD, [model], optimizer_kwargs={"lr": 0.1})
    else:
        model = layer
        opt = BasicOptimizer(torch.optim.SGD, [model], optimizer_kwargs={"lr": 0.1})
    opt.zero_grad()
    model(x).square().sum().backward()
    reference = _layer()
    weight_grad, bias_grad = torch.autograd.grad(reference(x).square().sum(), [reference.weight, reference.bias])
    # the grad norm is fp32 by design (so is this model: global_norm refuses float64 grads); the
    # bound is what reordering the sum of squares does in fp32
    squares = [torch.linalg.vector_norm(g).square() for g in (weight_grad, bias_grad, bias_grad)]
    expected, reordered = sum(squares).sqrt(), sum(reversed(squares)).sqrt()
    assert_close(opt.clip_grad_norm(1e9), expected, name="global grad norm",
                 tol=measured_tolerance(expected, reordered))

