"""ndweave.pipeline's engine vs torch pipelining's schedule driven by hand, on the same stages; and
the measured bubble next to the theory.

    python benchmarks/bench_pipeline.py                       # PP = 2 and 4 ranks, CPU/gloo
    python benchmarks/bench_pipeline.py --world-sizes 4 --schedules 1f1b zero_bubble --layers 16

Per world size (all of it the PP dim) and schedule it prints:

* step time (forward + backward of one mini-batch, no optimizer), median over interleaved rounds, in
  wall time and in the busiest rank's CPU time (which other jobs on a shared machine disturb less), of
  ``PipeEngine(module, mesh, loss_fn, plan)(x, y)`` and of torch's own schedule object built by hand
  over ``PipelineStage``s of the same chunks (``schedule.step(x)`` / ``step(target=y)``), and the
  ratio ours / torch (target: <= 1.0): what the engine's loss scaling, DP control, tied-weight and
  timing hooks cost;
* the bubble the engine's timeline measures (the share of the step, the slowest rank's schedule, each
  rank spends outside its actions, averaged; the median of ``--rounds`` recorded steps) next to the
  fill-drain theory ``(p - 1) / (v * m + p - 1)``, which assumes equal stages, free communication
  and hand-over, and a device per rank (it holds for any backward / forward ratio).

The model is a stack of Linear + ReLU blocks (no embedding, so every stage takes the same input).

``--simulate-ms F`` adds to every block a simulated device kernel (``ndweave.pipeline.testing``):
forward sleeps F ms and backward 2F ms (``time.sleep``, which leaves the CPU free, as a GPU kernel
does), with ``--width`` small so the real compute is negligible. That gives each rank its own
"device" even on 2 shared cores, so the measured bubble can be held against the theory. Zero bubble
runs a block's backward twice there (once for the input grad, once for the weight grad), so its
simulated timings are not comparable.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from common import Row, add_common_args, close, emit, init_rank, interleaved, spawn


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    from torch.distributed.pipelining import PipelineStage

    from ndweave.mesh import init_device_mesh
    from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage
    from ndweave.pipeline.plan import schedule_class
    from ndweave.pipeline.testing import KernelStack

    device = init_rank(rank, world, port, args.device, args.threads)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("PP",))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randn(args.batch, args.width, generator=g).to(device)
    results = []
    for schedule in args.schedules:
        virtual = 2 if schedule == "interleaved_1f1b" else 1
        plan = PipelineParallelPlan(schedule_type=schedule, num_microbatches=args.microbatches, virtual_chunks=virtual)

        def chunks():
            torch.manual_seed(0)  # ours and torch's chunks start from the same weights
            module = construct_pipeline_stage(KernelStack(args.layers, args.width, args.simulate_ms), plan, mesh)
            for chunk in module:
                chunk.to(device)
            return module

        ours_module = chunks()
        engine = PipeEngine(ours_module, mesh, _loss, plan)
        theirs_module = chunks()
        stages = [PipelineStage(chunk, stage, engine.resolved.num_stages, device, group=mesh["PP"].get_group())
                  for stage, chunk in zip(theirs_module.stage_indices, theirs_module.chunks)]
        cls = schedule_class(schedule)
        torch_schedule = cls(stages[0] if engine.resolved.single_stage else stages,
                             n_microbatches=args.microbatches, loss_fn=_loss)
        first, last = 0 in theirs_module.stage_indices, engine.resolved.num_stages - 1 in theirs_module.stage_indices

        def ours():
            engine(x, y)
            ours_module.zero_grad(set_to_none=True)

        def theirs():
            torch_schedule.step(*((x,) if first else ()), target=y if last else None)
            theirs_module.zero_grad(set_to_none=True)

        steps = {"ours": ours, "torch": theirs}
        for _ in range(args.warmup):
            for fn in steps.values():
                fn()
        timing = interleaved(steps, device, args.rounds, args.steps)
        engine.recorder.enabled = True
        timelines = []
        for _ in range(args.rounds):  # one step's bubble is one sample of the machine's noise: take the median
            ours()
            timelines.append(engine.timeline())
        timeline = sorted(timelines, key=lambda t: t.bubble_fraction)[len(timelines) // 2]
        results.append((schedule, timing["ours"], timing["torch"], timeline.bubble_fraction, timeline.theory,
                        timeline.text()))
    if rank == 0:
        queue.put(results)
    close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--simulate-ms", type=float, default=0.0,
                        help="a simulated device kernel per block: forward sleeps this many ms, backward twice")
    parser.add_argument("--show-timeline", action="store_true", help="print each run's text timeline")
    args = parser.parse_args()
    kernel = f" + a simulated {args.simulate_ms:g} ms kernel" if args.simulate_ms else ""
    print(f"Stack of {args.layers} x Linear({args.width}) + ReLU{kernel}, batch {args.batch}, {args.microbatches} "
          f"micro-batches, {args.device}, {args.threads} thread(s) per rank; ms per step, median round, wall and "
          f"the busiest rank's CPU time")
    print("| PP | schedule | ours ms | torch ms | ratio | ours CPU ms | torch CPU ms | ratio | bubble measured | "
          "theory (p-1)/(v*m+p-1) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for world in args.world_sizes:
        for schedule, ours, theirs, bubble, theory, text in spawn(_worker, world, args):
            print(f"| {world} | {schedule} | {ours.wall * 1e3:.1f} | {theirs.wall * 1e3:.1f} | "
                  f"{ours.wall / theirs.wall:.2f} | {ours.cpu * 1e3:.1f} | {theirs.cpu * 1e3:.1f} | "
                  f"{ours.cpu / theirs.cpu:.2f} | {bubble:.3f} | {theory:.3f} |", flush=True)
            if args.show_timeline:
                print(text)
            device = f", {args.simulate_ms:g} ms simulated kernels" if args.simulate_ms else \
                ", real compute: the bubble includes waiting for a core"
            rows.append(Row("ndweave.pipeline PipeEngine", f"torch {schedule} schedule driven by hand"
                            f"{', simulated device' if args.simulate_ms else ''}", world, ours.wall / theirs.wall,
                            ours.cpu / theirs.cpu, bound=f"bubble {bubble:.3f} vs theory {theory:.3f} "
                            f"({bubble / theory:.2f}x)",
                            note=f"{args.layers} x Linear({args.width}), {args.microbatches} micro-batches{device}"))
    emit(rows, args.json)


if __name__ == "__main__":
    main()
