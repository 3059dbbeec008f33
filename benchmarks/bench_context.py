"""ndweave context parallel (CP = the world) vs the whole sequence on every rank (CP=1): a causal GPT's
forward and backward on one long sequence, each rank's activation peak, and the keys and values each
rank receives per layer against the theory.

    python benchmarks/bench_context.py                       # world sizes 2 and 4, CPU/gloo
    python benchmarks/bench_context.py --seq 8192 --layers 4

Same model (the job's nanogpt, ``--layers`` blocks of width ``--width``), same weights, same sequence.

* ``whole``: every rank runs the whole sequence, as one process does (CPU's flash kernel, causal);
* ``cp``: ``ndweave.dmodule.context``: each rank a head and a tail chunk of ``seq / CP`` tokens, inside
  ``cp.attention()`` (keys and values all-gathered, causal blocks through the flash kernel).

Causal attention's work is ``seq^2 / 2`` per layer; CP divides it and every other layer's work by
CP, and adds the keys' and values' all-gather (again in backward) and their grads' reduce-scatter.
torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) is tried once on the same
mesh: on CPU it has no sharding rule for the flash kernel (torch 2.13), which the row says.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import Row, add_common_args, close, emit, init_rank, interleaved, spawn


def _model(args):
    from ndweave_gpt.models.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                         n_embd=args.width, dropout=0.0))


def _step(model, ids, targets, positions, cp) -> None:
    with cp.attention() if cp is not None else contextlib.nullcontext():
        logits, _ = model(ids, position_ids=positions)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    model.zero_grad(set_to_none=True)


def _activation_peak(model, batch, cp) -> int:
    from ndweave.mesh.testing.memory import TensorMemory

    with TensorMemory() as memory:  # (the model's parameters were made before: only what a step adds)
        _step(model, *batch, cp)
        return memory.peak_bytes("cpu")


def _received(model, batch, cp) -> int:
    """Bytes of keys and values one forward brings to this rank from the others."""
    from ndweave.dmodule.context import exchange

    received = [0]
    gather = exchange.all_gather_flat

    def counted(out, local, group):
        received[0] += (out.numel() - local.numel()) * out.element_size()
        return gather(out, local, group=group)

    exchange.all_gather_flat = counted
    try:
        with cp.attention(), torch.no_grad():
            model(batch[0], position_ids=batch[2])
    finally:
        exchange.all_gather_flat = gather
    return received[0]


def _torch_context_parallel(mesh, model, ids) -> str:
    """Whether torch's experimental ``context_parallel`` runs the same forward here (its error if not)."""
    from torch.distributed.tensor.experimental import context_parallel

    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    try:
        with context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1]), torch.no_grad():
            model(ids, position_ids=positions)
        return "runs"
    except Exception as error:  # noqa: BLE001 (any failure is the finding)
        return f"fails: {type(error).__name__}: {str(error).splitlines()[0][:120]}"


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    init_rank(rank, world, port, args.device, args.threads)
    from ndweave.dmodule.context import ContextParallel
    from ndweave.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("CP",))
    cp = ContextParallel(mesh)
    ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(ids, -1, dims=1)
    whole, ours = _model(args), _model(args)
    full = (ids, targets, torch.arange(args.seq).unsqueeze(0))
    mine = (cp.shard(ids), cp.shard(targets), cp.position_ids(args.seq))
    with torch.no_grad():  # same numbers from both (a benchmark of a wrong computation is worthless)
        with cp.attention():
            logits, _ = ours(mine[0], position_ids=mine[2])
        torch.testing.assert_close(logits, cp.shard(whole(ids)[0]), rtol=1e-4, atol=1e-5, msg="CP logits differ")
    runs = {"whole": functools.partial(_step, whole, *full, None), "cp": functools.partial(_step, ours, *mine, cp)}
    for fn in runs.values():
        for _ in range(args.warmup):
            fn()
    timing = interleaved(runs, torch.device("cpu"), args.rounds, args.steps)
    peaks = torch.tensor([_activation_peak(whole, full, None), _activation_peak(ours, mine, cp)], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    received = torch.tensor(float(_received(ours, mine, cp)), dtype=torch.float64)
    dist.all_reduce(received)
    theirs = _torch_context_parallel(mesh, _model(args), ids.clone())
    if rank == 0:
        queue.put({"timing": {k: (t.wall, t.best_wall, t.cpu) for k, t in timing.items()}, "peaks": peaks.tolist(),
                   "received": received.item() / world / args.layers, "torch": theirs})
    close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--seq", type=int, default=4096, help="tokens in the one sequence")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    if args.device != "cpu":
        raise SystemExit("bench_context: the mask-free causal path is CPU's flash kernel; run it on cpu")
    print(f"context parallel: GPT {args.layers} layers, width {args.width}, {args.heads} heads, one sequence of "
          f"{args.seq} tokens, fp32; CP=world vs the whole sequence per rank; fwd+bwd, median of {args.rounds} rounds "
          f"x {args.steps} steps")
    rows = []
    for world in args.world_sizes:
        res = spawn(_worker, world, args)
        t = res["timing"]
        for i, stat in enumerate(("wall, median round", "wall, best round", "CPU time, busiest rank")):
            print(f"world {world} ({stat}): whole sequence {t['whole'][i] * 1e3:.1f} ms/step | CP={world} "
                  f"{t['cp'][i] * 1e3:.1f} ms/step (ratio {t['cp'][i] / t['whole'][i]:.3f})")
        whole_peak, cp_peak = res["peaks"]
        theory = 2 * args.seq * args.width * 4 * (world - 1) / world  # K and V, fp32, the others' share
        print(f"world {world}: activation peak per rank {cp_peak / 1e6:.1f} MB vs {whole_peak / 1e6:.1f} MB "
              f"({cp_peak / whole_peak:.2f}x); K/V received per layer {res['received'] / 1e3:.0f} kB (theory "
              f"{theory / 1e3:.0f} kB); torch's context_parallel {res['torch']}")
        rows.append(Row(f"ndweave.dmodule.context (CP={world})", "the whole sequence on each rank (CP=1), causal GPT "
                        "fwd+bwd on one sequence", world, t["cp"][0] / t["whole"][0], t["cp"][2] / t["whole"][2],
                        memory=f"activation peak/rank {cp_peak / whole_peak:.2f}x",
                        bound=f"K/V received/layer {res['received'] / 1e3:.0f} kB vs theory 2·T·H·(CP−1)/CP "
                              f"{theory / 1e3:.0f} kB",
                        note=f"CPU ms/step CP {t['cp'][2] * 1e3:.0f}, whole {t['whole'][2] * 1e3:.0f}; T={args.seq}, "
                             f"{args.layers} layers, H={args.width}; torch's context_parallel {res['torch']}"))
    emit(rows, args.json)


if __name__ == "__main__":
    main()
