"""Token dispatch for expert parallelism, alone: each EP rank holds E/EP experts and routes its own
tokens; outputs and every gradient (tokens, router weights, expert weights) equal one process running
every expert on the whole batch, in float64. Uneven token counts, idle experts and top-k > 1."""

import pytest
import torch
import torch.distributed as dist

from ndweave.dmodule.experts.dispatch import combine, dispatch
from ndweave.mesh.testing import STRICT, STRICT_DTYPE, assert_close, distributed

_E, _H, _K = 8, 6, 2


def _batch(world: int):
    """The global batch: per rank a different number of tokens, expert choices avoiding expert 5."""
    g = torch.Generator().manual_seed(0)
    tokens = [3 + 2 * r for r in range(world)]
    x = torch.randn(sum(tokens), _H, generator=g, dtype=STRICT_DTYPE)
    scores = torch.randn(sum(tokens), _E, generator=g, dtype=STRICT_DTYPE)
    scores[:, 5] = -1e9  # an expert no token picks: an empty split
    weights, ids = torch.softmax(scores, -1).topk(_K, -1)
    experts = torch.randn(_E, _H, _H, generator=g, dtype=STRICT_DTYPE) / _H ** 0.5
    return tokens, x, weights, ids, experts


def _run_experts(rows: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.einsum("rh,roh->ro", rows, experts[ids]))


def _one_process(x, weights, ids, experts):
    """Every expert on its tokens, summed per token as transformers' eager experts do (index_add)."""
    out = torch.zeros_like(x)
    for e in range(_E):
        token, slot = torch.where(ids == e)
        out.index_add_(0, token, _run_experts(x[token], ids[token, slot], experts) * weights[token, slot, None])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_and_combine_equal_one_process(world):
    from ndweave.mesh.testing import run_distributed

    run_distributed(_compare, world, timeout=60)


def _compare():
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens, x, weights, ids, experts = _batch(world)
    leaves = [t.clone().requires_grad_() for t in (x, weights, experts)]
    reference = _one_process(*leaves[:2], ids, leaves[2])
    (reference * torch.arange(reference.numel(), dtype=STRICT_DTYPE).view_as(reference)).sum().backward()

    start, local = sum(tokens[:rank]), _E // world
    mine = slice(start, start + tokens[rank])
    x_local = x[mine].clone().requires_grad_()
    w_local = weights[mine].clone().requires_grad_()
    experts_local = experts[rank * local:(rank + 1) * local].clone().requires_grad_()
    received, local_ids, routing = dispatch(x_local, ids[mine], _E)
    assert torch.equal(local_ids, local_ids.sort().values)  # grouped by local expert
    assert sum(routing.tokens_per_expert) == received.shape[0]
    out = combine(_run_experts(received, local_ids, experts_local), w_local, routing)
    (out * torch.arange(reference.numel(), dtype=STRICT_DTYPE).view_as(reference)[mine]).sum().backward()

    assert_close(out, reference[mine], name="output", tol=STRICT)
    assert_close(x_local.grad, leaves[0].grad[mine], name="grad of the tokens", tol=STRICT)
    assert_close(w_local.grad, leaves[1].grad[mine], name="grad of the router weights", tol=STRICT)
    # an expert's grad sums over every rank's tokens: each rank holds its experts' whole grad
    assert_close(experts_local.grad, leaves[2].grad[rank * local:(rank + 1) * local], name="expert grads", tol=STRICT)


def test_one_process_dispatch_is_the_identity_routing():
    _, x, weights, ids, experts = _batch(1)
    received, local_ids, routing = dispatch(x, ids, _E)
    out = combine(_run_experts(received, local_ids, experts), weights, routing)
    assert_close(out, _one_process(x, weights, ids, experts), name="output", tol=STRICT)


@distributed(world_size=4, timeout=60)
def test_experts_that_do_not_divide_over_ep_are_refused():
    with pytest.raises(ValueError, match="6 experts do not divide over 4 EP ranks"):
        dispatch(torch.zeros(2, _H), torch.zeros(2, 1, dtype=torch.long), 6)


@distributed(world_size=2, timeout=60)
def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"top-k 5 \(expert_ids \(2, 5\)\) is more than the 4 experts"):
        dispatch(torch.zeros(2, _H), torch.zeros(2, 5, dtype=torch.long), 4)


@distributed(world_size=4, timeout=60)
def test_an_expert_id_out_of_range_on_one_rank_is_raised_on_every_rank():
    # EP rank 2 alone routes a token to expert 8 of 8 (0 .. 7): the others' data is fine, yet none of
    # them may wait for rows that never come
    ids = torch.tensor([[0, 3], [7, 1]])
    if dist.get_rank() == 2:
        ids[1, 0] = _E
    where = "this rank" if dist.get_rank() == 2 else r"EP ranks \[2\] \(this is EP rank \d\)"
    with pytest.raises(ValueError, match=where + r" routed tokens to expert ids outside \[0, 8\)"):
        dispatch(torch.zeros(2, _H), ids, _E)
    # the group is still in step: a good dispatch runs after it
    dispatch(torch.zeros(2, _H), torch.tensor([[0, 3], [7, 1]]), _E)
