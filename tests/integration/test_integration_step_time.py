"""The GPT job's step-time estimate (``ndweave_gpt.cost.step_time``) against the job's measured steps:
the estimate must put the layouts in the order the job runs them.

On 4 and 8 CPU ranks, a small grid of the job's layouts (PP x DP x CP x TP; GPipe, 1F1B,
interleaved 1F1B; a few micro-batch counts) is built as the job builds it, and the job's training step of each
is timed in rounds, one step of every layout per round (``interleaved_steps``), so that load from
elsewhere on the machine slows every layout alike; a layout's step is its fastest of ``ROUNDS``.
The estimate is ``estimate_step_seconds`` with this machine's calibration (``ndweave.plan.calibrate``,
measured once per session). Per world size: the Spearman rank correlation of predicted and measured
steps is at least ``MIN_SPEARMAN`` (the issue's 0.8), and the layout the estimate ranks first runs
within ``BEST_WITHIN`` (10%) of the fastest measured.

On this machine (2 cores shared by the 4 or 8 ranks, and by whatever else runs) compute is bound by
contention: the estimate models it (``Machine.concurrent_ranks``), and its absolute times are
1-4x short of the measured ones (printed side by side); the order is what is held to a bound.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import statistics
import time

import pytest
import torch

from ndweave.checkpoint import DataPosition
from ndweave.ddp import DEFAULT_BUCKET_SIZE
from ndweave.plan.calibrate import calibrate
from ndweave.mesh.testing import run_distributed, shutdown_pools
from ndweave_gpt.build import (adamw_kwargs, attending, build_mesh, build_model, build_optimizer, check_mesh,
                               context_batch, data_mean, data_rank, loss_fn, parallelize, sharding_plan)
from ndweave_gpt.config import parse_args
from ndweave_gpt.cost import step_time
from ndweave_gpt.data import TextData

MODEL = ["--n-layer", "8", "--n-embd", "128", "--n-head", "4", "--block-size", "64", "--global-batch", "16",
         "--steps", "100", "--warmup", "1"]
#: (mesh, schedule, virtual chunks, micro-batches) per world size
LAYOUTS = {
    4: [("dp=4", "1f1b", 1, 1), ("pp=4", "1f1b", 1, 8), ("pp=2,dp=2", "interleaved_1f1b", 2, 4),
        ("pp=4", "gpipe", 1, 16), ("pp=2,dp=2", "1f1b", 1, 8), ("dp=2,tp=2", "1f1b", 1, 1),
        ("pp=2,tp=2", "1f1b", 1, 4), ("dp=2,cp=2", "1f1b", 1, 1), ("cp=4", "1f1b", 1, 1)],
    8: [("dp=8", "1f1b", 1, 1), ("pp=8", "1f1b", 1, 8), ("pp=2,dp=4", "1f1b", 1, 4), ("pp=4,dp=2", "1f1b", 1, 8),
        ("pp=8", "1f1b", 1, 16), ("pp=2,dp=2,tp=2", "1f1b", 1, 2), ("dp=4,tp=2", "1f1b", 1, 2)],
}
#: Rounds of one step per layout (see ``interleaved_steps``); a layout's step is its fastest. One step
#: of 8 ranks on 2 shared cores varies by up to 2x from round to round.
ROUNDS = 8
MIN_SPEARMAN = 0.8
BEST_WITHIN = 0.10


def layout_argv(mesh: str, schedule: str, virtual: int, micro_batches: int) -> list[str]:
    """The job's flags for a layout."""
    return [*MODEL, "--mesh", mesh, "--schedule", schedule, "--virtual-chunks", str(virtual),
            "--micro-batches", str(micro_batches)]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def measured_steps(argvs: list[list[str]], world: int, rounds: int = ROUNDS) -> list[float]:
    """Each layout's step (seconds) as the job times it, on rank 0: the fastest of ``rounds`` steps,
    the layouts' steps taken in turn (round-robin), after one step each (which infers shapes)."""
    times = run_distributed(interleaved_steps, world, argvs, rounds, timeout=600)[0]
    return [min(t) for t in times]


def interleaved_steps(argvs: list[list[str]], rounds: int) -> list[list[float]]:
    """Every layout of ``argvs`` built as the job builds it (its own mesh, engine, DDP and ZeRO
    optimizer), then ``rounds`` rounds of one training step of each in turn, each step timed as the
    job's metrics time it: a burst of load from elsewhere on the machine slows every layout's step of
    a round alike, not one layout's every step. The step is ``ndweave_gpt.loop.loop``'s (the batch, the
    pipelined forward and backward with DDP's grad sync, the optimizer, the loss's mean over DP).
    Not ``ndweave_gpt.loop.train`` itself: its end gathers every parameter to every rank by ``all_gather_object``
    of views into DDP's buffers, which pickles each view's whole buffer (a minute and gigabytes per
    rank at 8 ranks), and writes a checkpoint."""
    jobs = [_Job(argv) for argv in argvs]
    times: list[list[float]] = [[] for _ in jobs]
    for _ in range(rounds):
        for one, out in zip(jobs, times):
            out.append(one.step())
    return times


class _Job:
    """One layout of the job, built and stepped once."""

    def __init__(self, argv: list[str]) -> None:
        self.args = args = parse_args(argv)
        self.mesh = build_mesh(args)
        check_mesh(self.mesh, args)
        self.dp_rank, self.dp_size = data_rank(self.mesh)
        job = parallelize(build_model(args), self.mesh, args)
        self.engine, self.cp = job.engine, job.cp
        self.optimizer, self.scheduler = build_optimizer(job.chunks, args)
        self.data, self.position = TextData(args.model.block_size, args.training.seed), DataPosition()
        self.step()

    def step(self) -> float:
        tick = time.perf_counter()
        x, y = context_batch(self.cp, *self.data.batch(self.position, self.args.data.global_batch, self.dp_rank,
                                                        self.dp_size))
        self.optimizer.zero_grad()
        with attending(self.cp):
            loss = self.engine(x, y).detach().to(torch.float64)
        self.optimizer.step()
        self.scheduler.step()
        self.position.advance(self.args.data.global_batch)
        data_mean(loss, self.mesh)
        return time.perf_counter() - tick


def predicted_steps(argvs: list[list[str]], machine) -> list[float]:
    """Each layout's estimated step (seconds), as the job would ask for it."""
    out = []
    for argv in argvs:
        args = parse_args(argv)
        sharding = functools.partial(_sharding, args)
        out.append(step_time.estimate_step_seconds(args, machine, build_model, sharding, loss_fn,
                                                   DEFAULT_BUCKET_SIZE, adamw_kwargs(args)).seconds)
    return out


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """This machine, measured once for the module (a few seconds), as ``calibrate`` keeps it."""
    return calibrate("cpu", path=tmp_path_factory.mktemp("calibration") / "machine.json")


def _ready() -> None:
    """Nothing: the ranks have started."""


def _sharding(args, model, sizes):
    return sharding_plan(model, args, sizes)


def test_spearman_of_known_orders():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)


# A timing CI's shared cores cannot hold, so -m slow (run it before the estimate changes): 8 ranks on 2
# cores time contention more than the layouts (on an AMD EPYC, pp=8 once ran 11% under the dp=8 the
# estimate ranks first), and at 4 ranks a clean-clone run of the suite read Spearman 0.683 once (0.967
# alone, on the same tree): the CP and pipeline layouts' steps moved past each other by a few percent.
@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_the_estimate_orders_the_layouts_as_the_job_runs_them(world, machine):
    layouts = LAYOUTS[world]
    argvs = [layout_argv(*layout) for layout in layouts]
    # measured on fresh ranks: a pool's ranks keep every group earlier tests made, each with a gloo thread
    # that polls (ndweave.mesh.testing.pool), and on 2 cores those steal from the ranks' hand-overs. In
    # the suite, on reused ranks, 8 ranks' pp=8 ran 1.3x dp=8's step; on fresh ones, 1.05-1.16x.
    shutdown_pools()
    # the estimates (seconds of tracing on meta) run while the ranks start, not while they are timed
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        start = time.perf_counter()
        estimating = background.submit(predicted_steps, argvs, machine)
        run_distributed(_ready, world)
        predicted = estimating.result()
        estimated_in = time.perf_counter() - start
    measured = measured_steps(argvs, world)
    rho = spearman(predicted, measured)
    print(f"\nworld {world} ({estimated_in:.1f} s to start the ranks and estimate all; calibration {machine})")
    print(f"{'layout':<40} {'predicted ms':>13} {'measured ms':>12}")
    for (mesh, schedule, v, mb), p, m in zip(layouts, predicted, measured):
        name = f"{mesh} {schedule}{f' v={v}' if v > 1 else ''} m={mb}"
        print(f"{name:<40} {p * 1e3:>13.0f} {m * 1e3:>12.0f}")
    chosen = min(range(len(layouts)), key=predicted.__getitem__)
    print(f"Spearman {rho:.3f}; chosen {layouts[chosen]}: measured {measured[chosen] * 1e3:.0f} ms, the fastest "
          f"{min(measured) * 1e3:.0f} ms")
    assert rho >= MIN_SPEARMAN, (rho, predicted, measured)
    assert measured[chosen] <= (1 + BEST_WITHIN) * min(measured), (layouts[chosen], measured)


@pytest.mark.parametrize("master", [torch.float32, torch.float64])
def test_the_optimizer_probe_clips_as_the_optimizer_does_in_every_master_dtype(master):
    """The probe's grad norm is computed as ``ndweave.optim.grad_norm`` computes it: at least fp32, a
    float64 model's in float64 (an fp32 norm of float64 grads raised, and ``--mesh auto --dtype
    float64`` with it)."""
    work = step_time._optimizer_work([64, 8], master, adamw_kwargs(parse_args([])), clip=1.0)
    assert work.bytes > 72 * 4 * master.itemsize  # (at least param, grad and Adam's two states read once)
