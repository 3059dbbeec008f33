"""Token dispatch for expert parallelism: send each token to the rank holding its expert, bring the
expert's output back, and combine, with autograd through both all-to-alls.

Each expert-parallel (EP) rank holds ``num_experts / EP`` whole experts, rank ``p`` experts
``[p * E/EP, (p + 1) * E/EP)``, and routes its own tokens. :func:`dispatch` sorts this rank's
(token, expert) assignments by expert, exchanges the counts (one small ``all_to_all_single``), then
the rows (one ``all_to_all_single`` with uneven splits), and groups what arrives by local expert:
the local experts then run on contiguous rows, as one process runs each expert on its tokens.
:func:`combine` reverses the moves and sums each token's expert outputs, weighted by its router
weights. Nothing is dropped (no capacity factor), so the result equals one process's. On meta
tensors (a trace before launch, which has no routing values) every expert gets an even share of the
rows and nothing is exchanged but the rows: an estimate's balanced routing.

Plain local tensors only (no DTensor): the moves are data-dependent, which DTensor cannot express.

    received, local_ids, routing = dispatch(x, top_k_index, num_experts, ep_group)
    y = run_local_experts(received, local_ids)           # rows grouped by local expert
    out = combine(y, top_k_weights, routing)             # (tokens, hidden), this rank's tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndweave.mesh.torch_compat import all_to_all_single

__all__ = ["Routing", "combine", "dispatch"]


@dataclass(frozen=True)
class Routing:
    """Where :func:`dispatch` moved this rank's tokens: what :func:`combine` needs to bring them back."""

    order: torch.Tensor
    """The (token, k) assignments of this rank, flattened, in the order they were sent (by expert)."""
    send_splits: list[int]
    """Rows sent to each EP rank (the experts it holds)."""
    receive_splits: list[int]
    """Rows received from each EP rank."""
    grouped: torch.Tensor
    """The received rows' order once grouped by local expert (a permutation of the received rows)."""
    tokens_per_expert: list[int]
    """Rows each local expert runs on, in local expert order."""
    top_k: int
    """Assignments per token."""
    group: dist.ProcessGroup | None
    """The EP group the rows moved over."""


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
             group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """Send row ``x[t]`` to the rank of each expert in ``expert_ids[t]`` (``(tokens, k)`` ints).

    Returns the rows this rank's experts must run (grouped by local expert), each row's local expert
    index (``0 .. num_experts / EP - 1``, ascending) and the :class:`Routing` for :func:`combine`. A
    collective over ``group`` (default: the world): every EP rank calls it, with its own tokens."""
    ep = dist.get_world_size(group) if dist.is_initialized() else 1
    if num_experts % ep:
        raise ValueError(f"expert parallel: {num_experts} experts do not divide over {ep} EP ranks; pick an EP "
                         f"size that divides {num_experts}")
    if expert_ids.shape[-1] > num_experts:
        raise ValueError(f"expert parallel: top-k {expert_ids.shape[-1]} (expert_ids {tuple(expert_ids.shape)}) is "
                         f"more than the {num_experts} experts; each token needs top-k distinct experts: lower top-k")
    local_experts = num_experts // ep
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: within an expert, tokens keep their order
    if flat.is_meta:
        counts, received_counts = _balanced_counts(flat.numel(), num_experts, ep, dist.get_rank(group))
    else:
        counts, received_counts = _exchanged_counts(flat, num_experts, ep, group)
    send_splits = counts.sum(1).tolist()
    receive_splits = received_counts.sum(1).tolist()
    rows = x.reshape(-1, x.shape[-1]).repeat_interleave(expert_ids.shape[-1], dim=0)[order]
    received = _all_to_all(rows, receive_splits, send_splits, group)
    # received: per source rank, its rows for local expert 0, 1, ...; regroup by local expert
    local_ids = torch.repeat_interleave(torch.arange(local_experts, device=x.device).repeat(ep),
                                        received_counts.reshape(-1).to(x.device), output_size=sum(receive_splits))
    grouped = torch.argsort(local_ids, stable=True)
    routing = Routing(order, send_splits, receive_splits, grouped, received_counts.sum(0).tolist(),
                      expert_ids.shape[-1], group)
    return received[grouped], local_ids[grouped], routing


def combine(y: torch.Tensor, weights: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Bring the experts' outputs ``y`` (rows as :func:`dispatch` returned them) back to their tokens
    and sum each token's ``top_k`` outputs weighted by ``weights`` (``(tokens, k)``): ``(tokens, hidden)``."""
    back = torch.empty_like(y).index_copy(0, routing.grouped, y)  # ungroup (autograd: a gather back)
    sent = _all_to_all(back, routing.send_splits, routing.receive_splits, routing.group)
    per_assignment = torch.empty_like(sent).index_copy(0, routing.order, sent)
    per_token = per_assignment.view(-1, routing.top_k, y.shape[-1])
    return (per_token * weights.unsqueeze(-1)).sum(1).to(y.dtype)


def _exchanged_counts(flat: torch.Tensor, num_experts: int, ep: int,
                      group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows this rank sends to each expert, and those each EP rank sends to this rank's experts:
    both ``(EP, local experts)``, from the routing's values and one exchange of counts."""
    local_experts = num_experts // ep
    outside = (flat < 0) | (flat >= num_experts)
    counts = torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts).view(ep, local_experts)
    # per destination rank, a last column flags expert ids outside [0, E): the flag travels with the
    # counts, so every EP rank raises (none waits on the rows)
    sent = torch.cat([counts, outside.any().to(counts.dtype).expand(ep, 1)], dim=1)
    exchanged = _exchange(sent.reshape(-1), group).view(ep, local_experts + 1)
    _check_expert_ids(exchanged[:, -1], num_experts, dist.get_rank(group) if dist.is_initialized() else 0)
    return counts, exchanged[:, :-1]


def _balanced_counts(assignments: int, num_experts: int, ep: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_exchanged_counts` for a trace on meta tensors (an estimate before launch), which has
    no routing to count: the ``assignments`` spread evenly over the experts, every EP rank routing as
    this one does (``rank``: this one's EP rank). A trained router balances its experts (its
    auxiliary loss); one far from balance holds more on its busiest rank than this counts."""
    share, rest = divmod(assignments, num_experts)
    counts = torch.tensor([share + (e < rest) for e in range(num_experts)]).view(ep, num_experts // ep)
    return counts, counts[rank].expand(ep, -1)


def _check_expert_ids(flags: torch.Tensor, num_experts: int, rank: int) -> None:
    """Raise (on every EP rank alike) if any EP rank routed a token to an expert id outside ``[0, E)``."""
    bad = flags.nonzero().flatten().tolist()
    if bad:
        where = "this rank" if bad == [rank] else f"EP ranks {bad} (this is EP rank {rank})"
        raise ValueError(f"expert parallel: {where} routed tokens to expert ids outside [0, {num_experts}); the "
                         f"router's top-k indices must be expert numbers below num_experts={num_experts}")


def _exchange(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's counts for this rank's experts (no autograd: integers)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts, group=group)
    return out


def _all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return rows
    if rows.is_meta:  # a trace: torch's functional collective runs on meta, and a dispatch mode sees it
        return all_to_all_single(rows.contiguous(), output_splits, input_splits, group or dist.group.WORLD)
    return _AllToAll.apply(rows, output_splits, input_splits, group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse move. (torch's public
    autograd version, ``torch.distributed.nn.functional.all_to_all_single``, is deprecated in favour of
    a private one, which a trace on meta uses: ``torch_compat.all_to_all_single``.)"""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _AllToAll.apply(grad, *ctx.splits, ctx.group), None, None, None
