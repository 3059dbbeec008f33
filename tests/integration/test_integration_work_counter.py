"""What the planner counts of other packages' code: ``ndweave.plan.work.WorkCounter`` over dmodule's
token dispatch on meta (a fake world), where the counter and the dispatch meet."""

import pytest
import torch
import torch.distributed as dist

from ndweave.dmodule.experts.dispatch import combine, dispatch
from ndweave.mesh import fake_world
from ndweave.plan.work import WorkCounter

_E, _H, _K = 8, 6, 2


@pytest.mark.parametrize("rank, receives", [(0, [8, 8]), (1, [6, 6])])
def test_on_meta_each_expert_gets_an_even_share_and_the_moves_are_counted(rank, receives):
    """A trace before launch (meta tensors, a fake world) has no routing values: each expert gets an
    even share of the assignments (7 tokens x top-2 over 8 experts: 2 on experts 0-5, 1 on 6-7), every
    EP rank routing alike (rank 1 holds experts 4-7: it receives 6 rows from each), and the two row
    moves each way are collectives of the EP group."""

    with fake_world(2, rank=rank):
        group = dist.new_group([0, 1])
        x = torch.empty(7, _H, device="meta", requires_grad=True)
        weights = torch.empty(7, _K, device="meta", requires_grad=True)
        with WorkCounter() as counter:
            received, local_ids, routing = dispatch(x, torch.empty(7, _K, dtype=torch.long, device="meta"), _E, group)
            out = combine(received * 2, weights, routing)
            out.sum().backward()
    assert routing.send_splits == [8, 6] and routing.receive_splits == receives
    assert sum(routing.tokens_per_expert) == sum(receives) and received.shape == (sum(receives), _H)
    assert local_ids.shape == (sum(receives),)
    assert out.shape == (7, _H) and x.grad.shape == (7, _H) and weights.grad.shape == (7, _K)
    moves = counter.work["all"].forward.collectives + counter.work["all"].backward.collectives
    assert [(kind, name) for kind, _, name in moves] == [("all_to_all", group.group_name)] * 4

