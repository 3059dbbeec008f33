"""ndweave expert parallel (EP=2) vs every expert replicated (EP=1, torch DDP): MoE step time at the
same global batch, and the token all-to-all's bytes per layer against the theory.

    python benchmarks/bench_experts.py                        # world sizes 2 and 4, CPU/gloo
    python benchmarks/bench_experts.py --world-sizes 4 --ep 4 --tokens 1024
    python benchmarks/bench_experts.py --device cuda          # NCCL, one GPU per rank

Same model (``--layers`` residual MoE blocks: a softmax router, top-k renormalized, ``--experts``
two-layer experts stacked in 3-D weights, run grouped by expert), same weights, same global batch (``--tokens`` per rank). Timed: forward + backward + grad sync.

* ``replicated``: every rank holds every expert; torch ``DistributedDataParallel`` over all ranks;
* ``ep``: ``parallelize_module`` with the ``expert_parallel`` patch over a ``("DP", "EP")`` mesh
  (each EP rank holds ``E/EP`` experts; tokens move to them and back with ``all_to_all_single``) and
  ndweave's DDP (dense grads over DP x EP, the experts' over DP).

Every rank runs the same number of (token, expert) rows either way (dropless: as many as it routes,
on average); EP trades the experts' grad all-reduce (and ``EP``-fold weight memory) for four
all-to-alls of rows per layer and step. The bytes are counted on one step: the rows that leave a
rank per layer each way (dispatch, then combine), the mean over ranks, against the theory for
uniform routing, ``top_k x tokens x hidden x (EP - 1) / EP`` elements (``2 tokens hidden (EP-1)/EP``
at top-2), plus the counts' exchange (``EP - 1`` small messages).
"""

from __future__ import annotations

import argparse
import functools
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from common import Row, add_common_args, close, emit, init_rank, interleaved, spawn


class Experts(nn.Module):
    """``num_experts`` experts (Linear(h, i), GELU, Linear(i, h)) stacked in 3-D weights, run grouped:
    the (token, expert) rows sorted by expert, one matmul pair per expert on its contiguous rows."""

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in, self.w_out = (nn.Parameter(torch.randn(num_experts, out, into) / into ** 0.5)
                                 for out, into in ((inner, hidden), (hidden, inner)))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k, flat = top_k_index.shape[-1], top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        rows = x.repeat_interleave(k, 0)[order].split(torch.bincount(flat, minlength=self.num_experts).tolist())
        y = torch.cat([nn.functional.gelu(r @ w_in.T) @ w_out.T for r, w_in, w_out in zip(rows, self.w_in, self.w_out)])
        y = torch.empty_like(y).index_copy(0, order, y) * top_k_weights.reshape(-1, 1)
        return y.view(-1, k, x.shape[-1]).sum(1)


class MoEBlock(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, 2 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = torch.softmax(self.router(x), -1).topk(self.top_k, -1)
        return x + self.experts(x, index, weights / weights.sum(-1, keepdim=True))


def _model(args) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[MoEBlock(args.experts, args.top_k, args.hidden) for _ in range(args.layers)])


def _step(model, x, ours: bool) -> None:
    model(x).pow(2).mean().backward()
    if ours:
        model.finish_grad_sync()
    model.zero_grad(set_to_none=True)


def _count_rows(model, x) -> tuple[float, float]:
    """One step's all-to-alls on this rank: (bytes of rows leaving it, bytes of counts leaving it)."""
    rows, counts = [0], [0]
    real = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        row = input.shape[1:].numel() * input.element_size()
        if input_split_sizes is None:  # the counts' exchange: even splits
            counts[0] += input.numel() * input.element_size() * (1 - 1 / dist.get_world_size(group))
        else:
            rows[0] += (sum(input_split_sizes) - input_split_sizes[dist.get_rank(group)]) * row
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    with mock.patch.object(dist, "all_to_all_single", counted):
        model(x).pow(2).mean().backward()  # forward (dispatch, combine) and backward (both reversed)
    model.zero_grad(set_to_none=True)
    return rows[0], counts[0]


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    device = init_rank(rank, world, port, args.device, args.threads)
    from torch.nn.parallel import DistributedDataParallel

    from ndweave.ddp import DDP
    from ndweave.dmodule import parallelize_module
    from ndweave.mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // args.ep, args.ep), mesh_dim_names=("DP", "EP"))
    replicated = DistributedDataParallel(_model(args).to(device), device_ids=None if device.type == "cpu" else [device])
    ep = DDP(parallelize_module(_model(args).to(device), mesh, {"patch": {r"\d+\.experts": ["expert_parallel"]}}),
             mesh)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1 + rank)).to(device)
    with torch.no_grad():  # same numbers from both (a benchmark of a wrong computation is worthless)
        torch.testing.assert_close(ep(x), replicated(x), rtol=1e-4, atol=1e-5, msg="EP output differs")
    models = {"replicated": (replicated, False), "ep": (ep, True)}
    for model, ours in models.values():  # warm up
        for _ in range(args.warmup):
            _step(model, x, ours)
    timing = interleaved({k: functools.partial(_step, m, x, ours) for k, (m, ours) in models.items()}, device,
                         args.rounds, args.steps)
    moved = torch.tensor(_count_rows(ep, x), dtype=torch.float64)
    dist.all_reduce(moved)
    if rank == 0:
        rows, counts = (moved / world).tolist()  # mean over ranks
        queue.put({"timing": {k: (t.wall, t.best_wall, t.cpu) for k, t in timing.items()},
                   "rows": rows / args.layers / 4, "counts": counts / args.layers})  # 4 row moves per layer
    close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--ep", type=int, default=2, help="EP size (divides every world size)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256, help="per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    print(f"MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts (inner {2 * args.hidden}), "
          f"top-{args.top_k}, {args.tokens} tokens per rank, EP={args.ep} vs replicated; {args.device}, "
          f"{args.threads} thread(s) per rank; fwd+bwd+grad sync, median of {args.rounds} rounds x {args.steps} steps")
    rows = []
    for world in args.world_sizes:
        res = spawn(_worker, world, args)
        t = res["timing"]
        for i, stat in enumerate(("wall, median round", "wall, best round", "CPU time, busiest rank")):
            print(f"world {world} ({stat}): replicated {t['replicated'][i] * 1e3:.2f} ms/step | EP={args.ep} "
                  f"{t['ep'][i] * 1e3:.2f} ms/step (ratio {t['ep'][i] / t['replicated'][i]:.3f})")
        theory = args.top_k * args.tokens * args.hidden * (args.ep - 1) / args.ep * 4  # float32
        print(f"world {world}: rows leaving a rank per layer each way {res['rows'] / 1e3:.1f} kB (theory "
              f"{theory / 1e3:.1f} kB, {res['rows'] / theory:.3f}x); counts {res['counts']:.0f} B per layer")
        rows.append(Row(f"ndweave.dmodule experts (EP={args.ep})", "torch DDP, experts replicated (EP=1), same "
                        f"global batch, MoE fwd+bwd", world, t["ep"][0] / t["replicated"][0],
                        t["ep"][2] / t["replicated"][2],
                        memory=f"expert weights/rank 1/{args.ep}",
                        bound=f"all-to-all rows/layer each way {res['rows'] / 1e3:.1f} kB vs theory k·T·H·(EP−1)/EP "
                              f"{theory / 1e3:.1f} kB ({res['rows'] / theory:.2f}x)",
                        note=f"CPU ms/step EP {t['ep'][2] * 1e3:.1f}, replicated {t['replicated'][2] * 1e3:.1f}; "
                             f"{args.layers} layers, {args.experts} experts top-{args.top_k}, T={args.tokens} "
                             f"tokens/rank, H={args.hidden}"))
    emit(rows, args.json)


if __name__ == "__main__":
    main()
