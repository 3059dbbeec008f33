"""ndweave.dmodule vs torch's ``parallelize_module`` (Colwise/Rowwise): tensor-parallel step time.

    python benchmarks/bench_dmodule.py                        # world sizes 2 and 4, CPU/gloo
    python benchmarks/bench_dmodule.py --world-sizes 2 --layers 8 --width 512 --tokens 512
    python benchmarks/bench_dmodule.py --device cuda          # NCCL, one GPU per rank

Same model (a stack of MLP blocks: Linear(d, 4d), GELU, Linear(4d, d)), same weights, same input,
same mesh and processes. Timed: forward + backward (+ ``finish_grad_sync`` for ours, which has
nothing to reduce under pure TP) over interleaved rounds: wall time (median and best round) and
the CPU time of the busiest rank (median round; the steadier figure on a shared machine, where wall
time swings with other load). Three variants:

* ``torch``: ``ColwiseParallel()`` on every fc1, ``RowwiseParallel()`` on every fc2; activations
  between modules are plain local tensors (``use_local_output=True``, torch's default);
* ``ours-local``: the same layout as an ndweave plan (fc1 output ``PlacementSpec([Shard(-1)],
  to_local=True)``, fc2 input ``[[Shard(-1)]]``, fc2 output ``PlacementSpec([Replicate()],
  to_local=True)``): what a like-for-like user plan looks like;
* ``ours-dtensor``: the seed's style (fc1 input ``[[Replicate()]]``, fc2 output
  ``[[Replicate()]]``): activations stay DTensors through GELU, paying DTensor dispatch per op;
* ``ours-via-dtensor``: ``ours-local`` with its linears run through DTensor's ops
  (``dtensor_linears()``) rather than on local shards: what the local linears save.

Printed per world size: ms/step of each and the ratios ours / torch (target: <= 1.0).
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch
from torch import nn

from common import Row, add_common_args, emit, init_rank, interleaved, report_and_close, spawn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _model(args) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(args.width) for _ in range(args.layers)])


def _torch_tp(mesh, args) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(args.layers):
        plan[f"{i}.fc1"] = ColwiseParallel()
        plan[f"{i}.fc2"] = RowwiseParallel()
    return parallelize_module(_model(args), mesh, plan)


def _ours(mesh, args, style: str) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard

    from ndweave.dmodule import PlacementSpec, parallelize_module

    R = Replicate()
    params = {r"\d+\.fc1.weight": [Shard(0)], r"\d+\.fc1.bias": [Shard(0)], r"\d+\.fc2.weight": [Shard(1)]}
    if style == "local":
        forward = {
            r"\d+\.fc1.input": [[R]],
            r"\d+\.fc1.output": [PlacementSpec([Shard(-1)], to_local=True)],
            r"\d+\.fc2.input": [[Shard(-1)]],
            r"\d+\.fc2.output": [PlacementSpec([R], to_local=True)],
        }
    else:
        forward = {r"\d+\.fc1.input": [[R]], r"\d+\.fc2.output": [[R]]}
    return parallelize_module(_model(args), mesh, {"parameter": params, "forward": forward})


def _step(model, x, ours: bool, via_dtensor: bool = False) -> None:
    from ndweave.dmodule import dtensor_linears

    with dtensor_linears() if via_dtensor else contextlib.nullcontext():
        out = model(x)
        out.pow(2).mean().backward()
    if ours:
        model.finish_grad_sync()
    model.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    device = init_rank(rank, world, port, args.device, args.threads)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("TP",))
    models = {
        "torch": (_torch_tp(mesh, args), False),
        "ours-local": (_ours(mesh, args, "local"), True),
        "ours-dtensor": (_ours(mesh, args, "dtensor"), True),
        "ours-via-dtensor": (_ours(mesh, args, "local"), True),
    }
    x = torch.randn(args.tokens, args.width, generator=torch.Generator().manual_seed(1)).to(device)
    # same numbers from all three (a benchmark of a wrong computation is worthless)
    with torch.no_grad():
        outs = {k: m(x) for k, (m, _) in models.items()}
    outs = {k: (o.full_tensor() if hasattr(o, "full_tensor") else o) for k, o in outs.items()}
    for k, o in outs.items():
        torch.testing.assert_close(o, outs["torch"], rtol=1e-4, atol=1e-5, msg=f"{k} output differs from torch's")
    steps = {k: functools.partial(_step, m, x, ours, k == "ours-via-dtensor") for k, (m, ours) in models.items()}
    for step in steps.values():  # warm up
        for _ in range(args.warmup):
            step()
    timing = interleaved(steps, device, args.rounds, args.steps)
    report_and_close(rank, timing, queue)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    print(f"MLP TP: {args.layers} blocks, width {args.width} (hidden {4 * args.width}), {args.tokens} tokens, "
          f"{args.device}, {args.threads} thread(s) per rank; forward+backward, median of {args.rounds} rounds "
          f"x {args.steps} steps")
    rows = []
    for world in args.world_sizes:
        res = spawn(_worker, world, args)
        for i, stat in enumerate(("wall, median round", "wall, best round", "CPU time, busiest rank")):
            t = res["torch"][i]
            print(f"world {world} ({stat}): torch {t * 1e3:.2f} ms/step | ours-local "
                  f"{res['ours-local'][i] * 1e3:.2f} ms/step (ratio {res['ours-local'][i] / t:.3f}) | ours-dtensor "
                  f"{res['ours-dtensor'][i] * 1e3:.2f} ms/step (ratio {res['ours-dtensor'][i] / t:.3f}) | "
                  f"ours-via-dtensor {res['ours-via-dtensor'][i] * 1e3:.2f} ms/step "
                  f"(ratio {res['ours-via-dtensor'][i] / t:.3f})")
        wall, cpu = res["torch"][0], res["torch"][2]
        rows += [Row("ndweave.dmodule", f"torch parallelize_module, MLP TP fwd+bwd ({plan})", world,
                     res[k][0] / wall, res[k][2] / cpu,
                     note=f"CPU ms/step ours {res[k][2] * 1e3:.1f}, torch {cpu * 1e3:.1f}")
                 for k, plan in (("ours-local", "like-for-like plan"), ("ours-dtensor", "DTensor activations"),
                                 ("ours-via-dtensor", "like-for-like plan, linears through DTensor"))]
    emit(rows, args.json)


if __name__ == "__main__":
    main()
