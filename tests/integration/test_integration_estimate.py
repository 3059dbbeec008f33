"""The GPT job's memory estimate (``--estimate``, ``ndweave_gpt.cost.estimate``) against the job itself,
before anything exists:

* model state, exactly: per rank the bytes of DDP's parameter and grad buffers and
  ``DistributedOptimizer``'s state and masters the estimate predicts are those the job allocates
  (PP x DP x TP with sequence parallel, PP x DP in bf16 with fp32 masters, HF Llama on the auto plan,
  MoE over PP x DP x EP, ZeRO-2);
* the peak: each rank's peak of live tensor bytes over the training steps (``--memory-check``,
  torch's tracker) against the estimate's, within ±5% (``PEAK_BOUND``) on every rank of 39 layouts
  over 1 to 8 ranks (``PEAK_CASES``: PP x DP x CP x EP x TP, ZeRO-1 and ZeRO-2, every kind of schedule,
  activation checkpointing, fp32 and bf16, the GPT, its MoE and HF Llama), and of the job's default
  model on a pipeline, from ranks as fresh as a launched job's (``PIPELINE_CASES``, issue #38);
* what a multi-stage schedule's sends hold until the step ends (``cost.in_flight.sent_bytes``);
* ``--estimate`` itself: a row per rank, and a clear error for a spec it cannot resolve.
"""

from __future__ import annotations

import math

import pytest
import torch

from ndweave.mesh import resolve_spec
from ndweave.mesh.testing import run_distributed
from ndweave.pipeline import PipelineParallelPlan
from ndweave.pipeline.plan import resolve_plan
from ndweave_gpt.__main__ import main
from ndweave_gpt.build import build_mesh, build_model, build_optimizer, data_rank, parallelize
from ndweave_gpt.config import DIMS, parse_args
from ndweave_gpt.cost import memory_estimate, plan_mesh
from ndweave_gpt.cost.in_flight import sent_bytes
from ndweave_gpt.loop import train

SMALL = ["--n-layer", "4", "--n-embd", "64", "--n-head", "4", "--block-size", "32", "--global-batch", "8",
         "--micro-batches", "2", "--steps", "2", "--quiet", "--plot", "", "--metrics", "", "--checkpoint-every", "0"]
#: The estimated peak over the measured peak of live tensor bytes stays within 1 ± this on every rank
#: of every layout in ``PEAK_CASES`` (measured here: 0.989 to 1.024; the part beyond the dataset every
#: rank holds, 2.4 MiB of the 3.6 to 7 MiB, alone: 0.975 to 1.070; MoE over EP, where the estimate
#: routes evenly and a rank's experts get what its router sends them: 0.982 to 1.015; ZeRO-2, whose
#: full-size buckets in flight are all counted at the backward's peak, an upper bound: 1.000 to 1.045;
#: CP, whose trace gathers the keys and values on meta: 0.979 to 1.015) and of ``PIPELINE_CASES``
#: (0.991 to 1.004)
PEAK_BOUND = 0.05


def _sizes(argv: list[str]) -> int:
    args = parse_args(argv)
    return math.prod(resolve_spec(args.parallel.mesh, None, dims=DIMS).values())


def _model_state(argv: list[str]) -> dict[str, int]:
    """What this rank's job allocates for parameters, grads and the optimizer (after one step)."""
    args = parse_args(argv)
    mesh = build_mesh(args)
    job = parallelize(build_model(args), mesh, args)
    chunks, engine = job.chunks, job.engine
    optimizer, _ = build_optimizer(chunks, args)
    x = torch.randint(0, 256, (args.data.global_batch // data_rank(mesh)[1], args.model.block_size))
    engine(x, x)
    optimizer.step()
    buckets = [b for c in chunks for b in c.grad_buckets()]
    return {"parameters": sum(b.param_data.numel() * b.param_data.element_size() for b in buckets),
            "gradients": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buckets),
            "optimizer state": optimizer.optimizer_state_bytes(), "master weights": optimizer.master_param_bytes()}


STATE_CASES = [
    ["--mesh", "pp=2,dp=2,tp=2"],
    ["--mesh", "pp=2,dp=4", "--dtype", "bf16", "--schedule", "interleaved_1f1b", "--virtual-chunks", "2"],
    ["--mesh", "dp=4,tp=2", "--model", "hf:llama", "--plan", "auto"],
    ["--mesh", "pp=2,dp=2,ep=2", "--moe-experts", "4"],
    ["--mesh", "pp=2,dp=2,tp=2", "--zero-stage", "2"],
]


@pytest.mark.heavy
def test_the_estimated_model_state_is_what_the_job_allocates_on_every_rank():
    argvs = [[*SMALL, *flags] for flags in STATE_CASES]
    allocated = run_distributed(_model_states, 8, argvs, timeout=300)  # per rank: one dict per case
    for case, argv in enumerate(argvs):
        predicted = memory_estimate(parse_args(argv))
        for rank, got in enumerate(r[case] for r in allocated):
            terms = predicted[rank].by_name()
            assert {k: terms[k] for k in got} == got, f"{STATE_CASES[case]} rank {rank}: predicted {terms}, allocated {got}"


def _model_states(argvs: list[list[str]]) -> list[dict[str, int]]:
    return [_model_state(argv) for argv in argvs]


#: Layouts by world size (one rank pool run each): PP x DP x TP (+SP) with ZeRO-1 over DP, every
#: kind of schedule (1F1B, GPipe, interleaved 1F1B, zero bubble with one and two stages per rank),
#: activation checkpointing, fp32 and bf16 (fp32 masters), the GPT and HF Llama on the zoo's and the
#: auto plan; tiny models, two steps each (the second has the optimizer state the first creates)
PEAK_CASES = {
    1: [["--mesh", "dp=1"],
        ["--mesh", "dp=1", "--model", "hf:llama", "--dtype", "bf16"],
        ["--mesh", "dp=1", "--activation-checkpointing", "--dtype", "bf16"]],
    2: [["--mesh", "dp=2"],
        ["--mesh", "dp=2", "--dtype", "bf16"],
        ["--mesh", "pp=2", "--schedule", "gpipe", "--micro-batches", "4"],
        ["--mesh", "pp=2", "--schedule", "interleaved_1f1b", "--virtual-chunks", "2", "--micro-batches", "4"],
        ["--mesh", "pp=2", "--schedule", "zero_bubble", "--micro-batches", "4"],
        ["--mesh", "pp=2", "--schedule", "zero_bubble", "--virtual-chunks", "2", "--micro-batches", "4"],
        ["--mesh", "tp=2"],
        ["--mesh", "tp=2", "--activation-checkpointing", "--dtype", "bf16"],
        ["--mesh", "tp=2", "--model", "hf:llama", "--plan", "auto"],
        ["--mesh", "pp=2", "--model", "hf:llama"],
        ["--mesh", "dp=2", "--model", "hf:llama", "--activation-checkpointing"],
        ["--mesh", "ep=2", "--moe-experts", "4", "--moe-top-k", "1", "--dtype", "bf16"],
        ["--mesh", "dp=2", "--zero-stage", "2", "--model", "hf:llama", "--dtype", "bf16"],
        ["--mesh", "cp=2", "--model", "hf:llama", "--activation-checkpointing"]],
    4: [["--mesh", "dp=4"],
        ["--mesh", "pp=4", "--micro-batches", "4"],
        ["--mesh", "pp=2,dp=2", "--schedule", "interleaved_1f1b", "--virtual-chunks", "2", "--dtype", "bf16"],
        ["--mesh", "pp=2,dp=2", "--schedule", "zero_bubble"],
        ["--mesh", "pp=2,tp=2", "--activation-checkpointing"],
        ["--mesh", "dp=2,tp=2", "--model", "hf:llama"],
        ["--mesh", "pp=2,tp=2", "--model", "hf:llama", "--plan", "auto", "--dtype", "bf16"],
        ["--mesh", "dp=2,ep=2", "--moe-experts", "4"],
        ["--mesh", "ep=4", "--moe-experts", "8", "--activation-checkpointing"],
        ["--mesh", "pp=2,ep=2", "--moe-experts", "4", "--schedule", "interleaved_1f1b", "--virtual-chunks", "2"],
        ["--mesh", "dp=4", "--zero-stage", "2", "--micro-batches", "1"],
        ["--mesh", "pp=2,dp=2", "--zero-stage", "2", "--schedule", "interleaved_1f1b", "--virtual-chunks", "2",
         "--dtype", "bf16"],
        ["--mesh", "dp=2,tp=2", "--zero-stage", "2", "--activation-checkpointing"],
        ["--mesh", "dp=2,ep=2", "--zero-stage", "2", "--moe-experts", "4"],
        ["--mesh", "pp=2,cp=2"],
        ["--mesh", "dp=2,cp=2", "--zero-stage", "2"],
        ["--mesh", "cp=2,tp=2", "--model", "hf:llama", "--plan", "auto"],
        ["--mesh", "cp=2,ep=2", "--moe-experts", "4"]],
    8: [["--mesh", "pp=2,dp=2,tp=2"],
        ["--mesh", "pp=2,dp=2,tp=2", "--model", "hf:llama", "--dtype", "bf16", "--schedule", "gpipe"],
        ["--mesh", "pp=4,dp=2", "--schedule", "interleaved_1f1b", "--virtual-chunks", "2", "--micro-batches", "4",
         "--global-batch", "16"],
        ["--mesh", "pp=2,dp=2,ep=2", "--moe-experts", "4"]],
}


def _peak_params():
    """Per world size its cases in one rank pool run; of the lists longer than two, CI runs every fourth
    case and ``-m slow`` the rest (run it before changing the estimate)."""
    for world, cases in sorted(PEAK_CASES.items()):
        if len(cases) <= 2:
            yield pytest.param(world, cases, id=f"world{world}")
            continue
        yield pytest.param(world, cases[::4], id=f"world{world}")
        yield pytest.param(world, [c for i, c in enumerate(cases) if i % 4], id=f"world{world}-rest",
                           marks=pytest.mark.slow)


@pytest.mark.heavy
@pytest.mark.parametrize(("world", "cases"), list(_peak_params()))
def test_each_ranks_measured_peak_is_near_the_estimate(world, cases, tmp_path):
    argvs = [[*SMALL, *flags, "--memory-check", "--checkpoint-dir", str(tmp_path / str(i))]
             for i, flags in enumerate(cases)]
    _check_peaks(world, cases, argvs)


def _check_peaks(world: int, cases: list[list[str]], argvs: list[list[str]]) -> None:
    """Every case's estimate within ``PEAK_BOUND`` of each rank's measured peak (one rank pool run)."""
    assert all(_sizes(argv) == world for argv in argvs)
    measured = run_distributed(_peaks_on_rank, world, argvs, timeout=600)[0]  # per case: every rank's peak
    off = _off_bound(cases, argvs, measured)
    assert not off, f"estimate / measured per rank: {off}"


def _off_bound(cases: list[list[str]], argvs: list[list[str]], measured: list[list[int]]) -> dict[str, list[float]]:
    """The cases whose estimate is off ``PEAK_BOUND`` on some rank: their ratio per rank."""
    off = {}
    for flags, argv, peaks in zip(cases, argvs, measured):
        ratios = [r.peak / m for r, m in zip(memory_estimate(parse_args(argv)), peaks)]
        if not all(abs(r - 1) <= PEAK_BOUND for r in ratios):
            off[" ".join(flags)] = [round(r, 3) for r in ratios]
    return off


def _peaks_on_rank(argvs: list[list[str]]) -> list[list[int]]:
    # torch's caches are left as the job finds them (no warm-up): on ranks that ran nothing before,
    # what the job's first trace leaves behind is in the peak
    return [train(parse_args(argv)).tensor_peak for argv in argvs]


#: The job's default model (fp32 GPT: 4 layers of width 128 over 64 tokens, 16 samples a step in 4
#: micro-batches per DP rank; about 4 times the small models' weights), 3 steps, on a pipeline, by world
#: size (one rank pool run each). Issue #38: launched, its estimate was 0.80 to 0.93 of the measured
#: peak, every rank holding the weights of the stages it does not run (the pipeline's trace kept the
#: whole model alive; ``test_pipeline_cost.py`` checks that it no longer does)
DEFAULT_MODEL = ["--steps", "3", "--quiet", "--plot", "", "--metrics", "", "--checkpoint-every", "0"]
PIPELINE_CASES = {
    2: [["--mesh", "pp=2"]],
    4: [["--mesh", "pp=2,dp=2"], ["--mesh", "pp=2,dp=2", "--schedule", "interleaved_1f1b", "--virtual-chunks", "2"]],
    8: [["--mesh", "pp=2,dp=2,tp=2"]],
}


@pytest.mark.heavy
@pytest.mark.parametrize("world", [pytest.param(w, id=f"world{w}", marks=[pytest.mark.slow] if w == 8 else [])
                                   for w in sorted(PIPELINE_CASES)])  # (8 ranks: 30 s on 2 cores; CI runs 2 and 4)
def test_the_default_models_peak_on_a_pipeline_is_near_the_estimate(world, tmp_path):
    argvs = [[*DEFAULT_MODEL, *flags, "--memory-check", "--checkpoint-dir", str(tmp_path / str(i))]
             for i, flags in enumerate(PIPELINE_CASES[world])]
    _check_peaks(world, PIPELINE_CASES[world], argvs)


def test_a_multi_stage_schedule_holds_what_a_rank_sends_another_until_the_step_ends():
    """``cost.in_flight.sent_bytes``: torch's multi-stage runtime waits on its sends at the step's end, so
    a stage's output sent on and its input grads sent back stay held until then; a V-shaped schedule
    hands the stage at its turn (1 -> 2, on one rank) its tensors without a send."""
    outputs, inputs = [10, 20, 30, 40], [0, 1, 2, 3]  # per stage: its output, its input (0: token ids)
    for schedule, expected in [("interleaved_1f1b", ([10, 20, 30, 0], [0, 1, 2, 3])),
                               ("zbv_zero_bubble", ([10, 0, 30, 0], [0, 1, 0, 3]))]:
        resolved = resolve_plan(PipelineParallelPlan(schedule_type=schedule, virtual_chunks=2, num_microbatches=4), 2)
        assert sent_bytes(resolved, outputs, inputs) == expected, schedule


def test_estimate_prints_a_row_per_rank_and_names_what_it_cannot_estimate(capsys):
    assert main([*SMALL, "--mesh", "pp=2,dp=2,tp=2", "--estimate"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert "activations" in rows[0] and "peak MiB" in rows[0] and len(rows) == 1 + 8
    assert main([*SMALL, "--mesh", "dp=2,ep=2", "--moe-experts", "4", "--estimate"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + 4  # experts over EP: balanced routing
    with pytest.raises(SystemExit, match="--estimate: .*DP=-1, which needs the world size"):
        main([*SMALL, "--mesh", "dp=-1", "--estimate"])


@pytest.mark.heavy
def test_mesh_auto_prints_the_table_and_its_choice_runs(capsys, tmp_path):
    base = [*SMALL, "--checkpoint-dir", str(tmp_path)]
    argv = plan_mesh(parse_args(["--mesh", "auto", "--world-size", "2", *base]), ["--mesh", "auto", *base])
    table = capsys.readouterr().out
    assert "<- chosen" in table and "cut" in table
    args = parse_args(argv)
    assert args.parallel.mesh != "auto" and math.prod(resolve_spec(args.parallel.mesh, None, dims=DIMS).values()) == 2
    chosen = next(line for line in table.splitlines() if "<- chosen" in line)
    assert chosen.split()[0] == args.parallel.mesh.replace("ep=1,", "")  # the table's row is what runs
    losses = run_distributed(_losses_on_rank, 2, [*argv, "--steps", "1"], timeout=300)
    assert losses[0] == losses[1] and len(losses[0]) == 1


def _losses_on_rank(argv: list[str]) -> list[float]:
    return list(train(parse_args(argv)).losses.values())
