"""``ndweave.plan.work.WorkCounter``: what a region of a program asks of a machine, counted on meta."""

import torch
import torch.distributed as dist

from ndweave.mesh import fake_world
from ndweave.mesh import torch_compat as tc
from ndweave.plan.work import WorkCounter


def test_all_to_all_single_runs_on_meta_with_autograd_and_is_seen_with_its_group():
    with fake_world(2, rank=0):
        group = dist.new_group([0, 1])
        rows = torch.empty(5, 3, device="meta", requires_grad=True)
        with WorkCounter() as counter:
            moved = tc.all_to_all_single(rows, [4, 2], [3, 2], group)
            moved.sum().backward()
        assert moved.shape == (6, 3) and rows.grad.shape == (5, 3)
        work = counter.work["all"]
        assert work.forward.collectives == [("all_to_all", 5 * 3 * 4, group.group_name)]
        assert work.backward.collectives == [("all_to_all", 6 * 3 * 4, group.group_name)]
