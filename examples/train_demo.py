"""ndweave's main job: train nanoGPT with DP x TP (+ sequence parallel) and a ZeRO optimizer, then
prove it: every rank also trains the same model on one process and compares losses and parameters.

    hatch run demo                                   # 4 CPU ranks: DP=2 x TP=2
    torchrun --standalone --nproc-per-node 4 examples/train_demo.py --dp 2 --tp 2 --steps 30

On GPUs the same command runs with ``--device cuda`` (NCCL); nothing here names a backend.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, GPTConfig  # noqa: E402

from ndweave.ddp import DistributedDataParallel as DDP  # noqa: E402
from ndweave.dmodule import get_plan, parallelize_module  # noqa: E402
from ndweave.mesh import DEVICE_MESH  # noqa: E402
from ndweave.mesh.testing import SAFETY, Tolerance, full_tensor, max_difference, measured_tolerance  # noqa: E402
from ndweave.optim import DistributedOptimizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel size")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--no-sp", action="store_true", help="tensor parallel without sequence parallel")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over DP)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu", help="cpu (gloo), or cuda (NCCL, one GPU per rank)")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def model_config() -> GPTConfig:
    # No biases: a key-projection bias has an exactly-zero true gradient, which AdamW would turn into
    # full-size steps driven by rounding noise, making any two runs (even two single-process runs
    # with different summation orders) drift apart in that one parameter.
    return GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=False)


def make_batches(cfg: GPTConfig, steps: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token streams from a fixed random Markov chain: each token has 3 likely successors, so a model
    can learn it and the loss falls towards the chain's entropy (about ln 3 = 1.1)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, cfg.vocab_size, (cfg.vocab_size, 3), generator=g)
    batches = []
    for _ in range(steps):
        seq = torch.empty(batch, cfg.block_size + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
        for t in range(cfg.block_size):
            pick = torch.randint(0, 3, (batch,), generator=g)
            seq[:, t + 1] = successors[seq[:, t], pick]
        batches.append((seq[:, :-1], seq[:, 1:]))
    return batches


def train_parallel(model: GPT, batches, args, device: str) -> tuple[list[float], torch.nn.Module]:
    dp_rank = DEVICE_MESH.get_data_parallel_rank()
    plan = get_plan("nanogpt", model, sequence_parallel=not args.no_sp)
    model = parallelize_module(model, DEVICE_MESH["TP"], plan)
    model = DDP(model, DEVICE_MESH["DP"], use_distributed_optimizer=True)
    optimizer = DistributedOptimizer(
        torch.optim.AdamW, models=[model], clip_grad=1.0, overlap_param_gather=True,
        optimizer_kwargs={"lr": args.lr, "weight_decay": 0.1},
    )
    losses = []
    for x, y in batches:
        x, y = x.chunk(args.dp)[dp_rank].to(device), y.chunk(args.dp)[dp_rank].to(device)
        optimizer.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        # each DP rank saw an equal slice: the global loss is the mean over DP
        local = full_tensor(loss).reshape(1).to(device)
        dist.all_reduce(local, group=DEVICE_MESH.get_data_parallel_group())
        losses.append(local.item() / args.dp)
    return losses, model


def train_reference(model: GPT, batches, args, device: str,
                    micro_batches: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training: (losses, final parameters). ``micro_batches > 1`` accumulates each
    batch's gradient over that many equal micro-batches: the same math, summed in another order."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            _, loss = model(xs.to(device), ys.to(device))
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(total)
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def measured_bounds(initial: GPT, batches, args, device: str, reference_run) -> tuple[Tolerance, Tolerance]:
    """How close "matches" is, for losses and for parameters: measured on this machine from
    single-process runs that differ only in summation order (whole batches, and accumulated
    micro-batches of two sizes). Parallel runs sum in other orders too (all-reduce, reduce-scatter,
    split matmuls), and AdamW turns rounding noise on near-zero grads into real steps: no fixed fp32
    constant holds on every CPU's kernels."""
    runs = [train_reference(copy.deepcopy(initial), batches, args, device, micro_batches=k)
            for k in sorted({2, args.batch})]
    return (measured_tolerance(reference_run[0], *(losses for losses, _ in runs)),
            measured_tolerance(reference_run[1], *(params for _, params in runs)))


def main() -> int:
    args = parse_args()
    DEVICE_MESH.init_device_mesh(args.device, (args.dp, args.tp), mesh_dim_names=("DP", "TP"))
    rank = dist.get_rank()
    cfg = model_config()
    batches = make_batches(cfg, args.steps, args.batch, args.seed)
    torch.manual_seed(args.seed)
    initial = GPT(cfg).to(args.device)

    start = time.perf_counter()
    losses, model = train_parallel(copy.deepcopy(initial), batches, args, args.device)
    elapsed = time.perf_counter() - start
    ref_losses, ref_params = train_reference(copy.deepcopy(initial), batches, args, args.device)
    loss_tol, param_tol = measured_bounds(initial, batches, args, args.device, (ref_losses, ref_params))

    params = {name: full_tensor(p) for name, p in model.named_parameters()}  # collectives over TP
    worst = max_difference(params, ref_params)
    loss_gap = max_difference(losses, ref_losses)
    ok = worst <= param_tol.atol and loss_gap <= loss_tol.atol
    if rank == 0:
        mode = "TP+SP" if not args.no_sp else "TP"
        print(f"ndweave demo: nanoGPT on {args.device}, DP={args.dp} x {mode}={args.tp}, ZeRO (DistributedOptimizer)")
        print(f"{'step':>5} {'loss (ndweave)':>15} {'loss (1 process)':>17}")
        for i in sorted(set(range(0, args.steps, max(1, args.steps // 10))) | {args.steps - 1}):
            print(f"{i:>5} {losses[i]:>15.6f} {ref_losses[i]:>17.6f}")
        print(f"parallel training took {elapsed:.2f}s for {args.steps} steps")
        print(f"max |loss difference| = {loss_gap:.2e} (bound {loss_tol.atol:.1e}); "
              f"max |parameter difference| = {worst:.2e} (bound {param_tol.atol:.1e})")
        print(f"bounds: {SAFETY:g}x the spread of single-process runs that differ only in summation order")
        print("PASS: the parallel run matches single-process training" if ok else "FAIL: runs differ")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
