"""ndweave.dmodule's automatic plan: how long ``get_plan("auto", model)`` takes, and whether the plan
it writes trains as fast as the zoo's hand-written one.

    python benchmarks/bench_dmodule_auto.py                   # world sizes 2 and 4, CPU/gloo
    python benchmarks/bench_dmodule_auto.py --world-sizes 2 --layers 4 --width 256 --tokens 256

Needs transformers (the models are its Llama); without it the benchmark says so and writes no row.

* **Derivation**: ``get_plan("auto", model)`` on a Llama-2-7B-sized ``LlamaForCausalLM`` (32
  layers, hidden 4096) built on the meta device, as a user plans a model too large for one process
  before materializing it: the process CPU time of the whole derivation (tracing a meta copy,
  finding the blocks, emitting and verifying the plan), median of ``--derive-rounds`` runs, with
  and without sequence parallelism. Target: well under 5 s.
* **Step time**: a small Llama (``--layers``, ``--width``, 8 heads, 4 key/value heads) under tensor
  parallelism, once with ``get_plan("auto", model)`` and once with the zoo's
  ``get_plan("hf_llama", model)``; the same weights and input, checked to give the same logits.
  Timed: forward + backward + ``finish_grad_sync`` over interleaved rounds (see ``common.py``),
  half of them zoo first, half auto first (the first of a round runs faster on CPU).
  The row's ratios are auto / zoo (target: <= 1.02): the auto plan's generalized patches
  (``fused_colwise``, ``tp_divides``) against the zoo's per-model ones.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import astuple

import torch
import torch.nn.functional as F

from common import Row, Timing, add_common_args, emit, init_rank, interleaved, report_and_close, spawn


def _llama(args, layers: int | None = None, **sizes):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(sizes or dict(vocab_size=args.vocab, hidden_size=args.width,
                                          intermediate_size=2 * args.width, num_attention_heads=8,
                                          num_key_value_heads=4, max_position_embeddings=args.tokens)),
                         num_hidden_layers=layers or args.layers)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def derivation_seconds(rounds: int, sequence_parallel: bool) -> float:
    """Median process CPU seconds of ``get_plan("auto")`` on a 32-layer Llama-2-7B built on meta."""
    from ndweave.dmodule.plans import get_plan

    with torch.device("meta"):
        model = _llama(None, layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000)
    times = []
    for _ in range(rounds):
        start = time.process_time()
        get_plan("auto", model, sequence_parallel=sequence_parallel)
        times.append(time.process_time() - start)
    return statistics.median(times)


def _step(model, ids, targets) -> None:
    logits = model(ids).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    model.finish_grad_sync()
    model.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    device = init_rank(rank, world, port, args.device, args.threads)
    from torch.distributed.device_mesh import init_device_mesh

    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("TP",))
    models = {}
    for name in ("zoo", "auto"):
        model = _llama(args).to(device)
        plan = get_plan("hf_llama" if name == "zoo" else "auto", model, sequence_parallel=args.sequence_parallel)
        models[name] = parallelize_module(model, mesh, plan)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g).to(device)
    targets = torch.roll(ids, -1, dims=1)
    with torch.no_grad():  # the same numbers from both (a benchmark of a wrong computation is worthless)
        outs = {k: m(ids).logits for k, m in models.items()}
    outs = {k: o.full_tensor() if hasattr(o, "full_tensor") else o for k, o in outs.items()}
    torch.testing.assert_close(outs["auto"], outs["zoo"], msg="the auto plan's logits differ from the zoo plan's")
    for model in models.values():  # warm up
        for _ in range(args.warmup):
            _step(model, ids, targets)
    steps = {k: functools.partial(_step, m, ids, targets) for k, m in models.items()}
    # the first in each round runs measurably faster here (~8% on CPU): half the rounds in each order
    first = interleaved(steps, device, args.rounds, args.steps)
    second = interleaved(dict(reversed(steps.items())), device, args.rounds, args.steps)
    timing = {k: Timing(*((a + b) / 2 for a, b in zip(astuple(first[k]), astuple(second[k])))) for k in steps}
    report_and_close(rank, timing, queue)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=128, help="sequence length")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--derive-rounds", type=int, default=3)
    args = p.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_dmodule_auto: skipped (needs transformers: pip install transformers)")
        return
    derive = {sp: derivation_seconds(args.derive_rounds, sp) for sp in (False, True)}
    print(f'get_plan("auto") on a 32-layer Llama-2-7B on meta: {derive[False]:.2f} s CPU (TP), '
          f"{derive[True]:.2f} s CPU (TP+SP), median of {args.derive_rounds}")
    print(f"Llama TP: {args.layers} layers, width {args.width}, 8 heads (4 key/value), batch {args.batch} x "
          f"{args.tokens} tokens, {'TP+SP' if args.sequence_parallel else 'TP'}, {args.device}, {args.threads} "
          f"thread(s) per rank; forward+backward, median of {args.rounds} rounds x {args.steps} steps")
    rows = []
    for world in args.world_sizes:
        res = spawn(_worker, world, args)
        for i, stat in enumerate(("wall, median round", "wall, best round", "CPU time, busiest rank")):
            zoo, auto = res["zoo"][i], res["auto"][i]
            print(f"world {world} ({stat}): zoo plan {zoo * 1e3:.2f} ms/step | auto plan {auto * 1e3:.2f} ms/step "
                  f"(ratio {auto / zoo:.3f})")
        rows.append(Row("ndweave.dmodule", 'get_plan("auto") vs the zoo\'s hf_llama plan, Llama TP fwd+bwd', world,
                        res["auto"][0] / res["zoo"][0], res["auto"][2] / res["zoo"][2],
                        bound="ratio <= 1.02",
                        note=f"CPU ms/step auto {res['auto'][2] * 1e3:.1f}, zoo {res['zoo'][2] * 1e3:.1f}; "
                             f"deriving the plan of a 32-layer 7B Llama on meta: {derive[False]:.2f} s CPU"))
    emit(rows, args.json)


if __name__ == "__main__":
    main()
