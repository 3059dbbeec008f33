"""The job with ``--compile`` (issue #41): each transformer block compiled by inductor once the plan is
applied, before DDP wraps it. At PP=2 x DP=2 (ZeRO-1, 1F1B) in float64 the compiled job's losses and
final parameters equal the eager job's to the strict tolerance, and rank 0 reports the step that
compiled apart from the others; with TP inside stages, and with experts over EP (a graph break per
block, at the token dispatch, reported), too. The GPT's compiled TP blocks inside DDP, ZeRO-1 and
ZeRO-2 train like one process."""

from __future__ import annotations

import pytest
import torch

from dmodule.dmodule_auto_models import FLOAT32_INSIDE
from ndweave.mesh.testing import assert_close, run_distributed
from ndweave_gpt.metrics import say
from test_integration_gpt_job import TINY, _run


def _run_and_report(argv: list[str]):
    """The job, and what rank 0 said about compiling (``say``'s lines)."""
    from ndweave_gpt import loop

    said: list[str] = []
    loop.say = said.append
    try:
        return _run(argv), said
    finally:
        loop.say = say


@pytest.mark.parity
def test_the_compiled_job_trains_as_the_eager_one(tmp_path):
    base = [*TINY, "--mesh", "pp=2,dp=2", "--steps", "3", "--checkpoint-dir", str(tmp_path), "--resume", "never"]
    eager = run_distributed(_run, 4, base, timeout=600)[0]
    shown = [a for a in base if a != "--quiet"]  # (rank 0 reports the compile where the run is not quiet)
    compiled, said = run_distributed(_run_and_report, 4, [*shown, "--compile"], timeout=900)[0]
    steps = sorted(eager.losses)
    assert_close(torch.tensor([compiled.losses[s] for s in steps], dtype=torch.float64),
                 torch.tensor([eager.losses[s] for s in steps], dtype=torch.float64), name="losses")
    for name, p in eager.params.items():
        assert_close(compiled.params[name], p, name=name)
    compiles = [line for line in said if line.startswith("compile:")]
    assert len(compiles) == 1 and compiles[0].startswith("compile: step 1 compiled") and "break" not in compiles[0], said


@pytest.mark.parity
@pytest.mark.parametrize("schedule", ["zero_bubble", pytest.param("interleaved_1f1b", marks=pytest.mark.heavy),
                                      pytest.param("gpipe", marks=pytest.mark.heavy)])
def test_every_schedule_trains_compiled_as_eager(tmp_path, schedule):
    """PP=2, two stages per rank where the schedule takes them: zero bubble's split backward (input
    grads, then weight grads) keeps each compiled block's graph between the two, which a compiled
    backward allows only without donated buffers (the engine's ``compiled_backward_retained``)."""
    chunks = [] if schedule == "gpipe" else ["--virtual-chunks", "2", "--n-layer", "4"]
    base = [*TINY, "--mesh", "pp=2", "--schedule", schedule, *chunks, "--steps", "3", "--resume", "never",
            "--checkpoint-every", "0"]
    eager = run_distributed(_run, 2, [*base, "--checkpoint-dir", str(tmp_path / "eager")], timeout=600)[0]
    compiled = run_distributed(_run, 2, [*base, "--compile", "--checkpoint-dir", str(tmp_path / "compiled")],
                               timeout=900)[0]
    for step, loss in eager.losses.items():
        assert_close(torch.tensor(compiled.losses[step], dtype=torch.float64), torch.tensor(loss, dtype=torch.float64),
                     name=f"{schedule} step {step} loss")
    for name, p in eager.params.items():
        assert_close(compiled.params[name], p, name=f"{schedule} {name}")


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize(("mesh", "world", "resume_mesh", "resume_world", "extra"), [
    # (8 ranks compiling: 30 s on 2 cores; CI runs EP, and TP inside DDP below)
    pytest.param("pp=2,dp=2,tp=2", 8, "dp=2,tp=2", 4, [], marks=pytest.mark.slow),
    ("dp=2,ep=2", 4, "dp=2", 2, ["--moe-experts", "4", "--moe-top-k", "2"])])
def test_the_compiled_job_trains_and_resumes_as_the_eager_one_with_tp_and_ep(tmp_path, mesh, world, resume_mesh,
                                                                            resume_world, extra):
    """The meshes the issue names: TP (+SP) inside pipeline stages and data ranks (ZeRO-1), and MoE
    blocks whose experts are divided over EP. Under EP the graph breaks only at the experts' token
    dispatch, and the job says why. The compiled run's step-2 checkpoint (its FQNs the model's own)
    resumes compiled on another mesh, and step 3 equals the eager run's."""
    base = [*TINY, "--steps", "3", "--checkpoint-every", "0", *extra]
    eager = run_distributed(_run, world, [*base, "--mesh", mesh, "--checkpoint-dir", str(tmp_path / "eager"),
                                          "--resume", "never"], timeout=600)[0]
    # (a rank compiling its blocks keeps its peers waiting in collectives: a cold compile at 8 ranks on 2
    # cores took 32 s, over the default --timeout of 30 s; the first step waits --compile-timeout instead)
    shown = [a for a in base if a != "--quiet"] + ["--compile", "--checkpoint-dir", str(tmp_path / "compiled")]
    compiled, said = run_distributed(_run_and_report, world, [*shown, "--mesh", mesh, "--stop-at", "2"],
                                     timeout=900)[0]
    resumed = run_distributed(_run, resume_world, [*shown, "--quiet", "--mesh", resume_mesh, "--resume"],
                              timeout=900)[0]
    assert sorted(compiled.losses) == [1, 2] and sorted(resumed.losses) == [3]
    for step, loss in [*compiled.losses.items(), *resumed.losses.items()]:
        assert_close(torch.tensor(loss, dtype=torch.float64), torch.tensor(eager.losses[step], dtype=torch.float64),
                     name=f"step {step} loss")
    for name, p in eager.params.items():
        assert_close(resumed.params[name], p, name=f"{name} after the compiled resume at {resume_mesh}")
    compiles = [line for line in said if line.startswith("compile:")]
    assert len(compiles) == 1, said
    if "ep" in mesh:
        assert "graph break" in compiles[0] and "token all-to-all" in compiles[0], compiles
    else:
        assert "break" not in compiles[0], compiles


def test_the_steps_that_compile_wait_longer_then_the_groups_get_the_timeout():
    """--compile: the groups are made with --compile-timeout, since the first step (and the first to
    evaluate) compiles while peers wait; after it they get --timeout, and a group made with a timeout
    of its own keeps it."""
    from ndweave_gpt.config import parse_args
    from ndweave_gpt.loop import last_compiling_step

    config = parse_args([*TINY, "--steps", "10", "--compile"])
    assert last_compiling_step(config, 0) == 1 and last_compiling_step(config, 6) == 7
    evaluating = parse_args([*TINY, "--steps", "10", "--compile", "--eval-every", "4"])
    assert [last_compiling_step(evaluating, start) for start in (0, 3, 4, 9)] == [4, 4, 8, 10]
    run_distributed(_settled_timeouts, 4, timeout=120)


def _settled_timeouts() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from ndweave.mesh.torch_compat import group_timeout
    from ndweave_gpt.build import build_mesh
    from ndweave_gpt.config import parse_args
    from ndweave_gpt.loop import settle_timeouts

    config = parse_args([*TINY, "--mesh", "dp=2,tp=2", "--compile", "--compile-timeout", "120", "--timeout", "20"])
    mesh = build_mesh(config)  # (its dim groups; the pool's default group was made before, and keeps its own)
    made = [mesh["DP"].get_group(), mesh["TP"].get_group(),
            dist.new_group(backend="gloo", timeout=timedelta(seconds=120))]  # (as the pipeline's own group)
    own = dist.new_group(backend="gloo", timeout=timedelta(seconds=77))
    assert [group_timeout(g) for g in made] == [timedelta(seconds=120)] * 3
    settle_timeouts(config)
    assert [group_timeout(g) for g in made] == [timedelta(seconds=20)] * 3
    assert group_timeout(own) == timedelta(seconds=77)
    dist.all_reduce(torch.ones(1), group=made[2])  # (the lowered group still works)


@pytest.mark.parity
@pytest.mark.parametrize(("compiled", "zero_stage"), [
    # (after DDP at ZeRO-2: 23 s of CI on 2 cores; the LoRA test below compiles after wrapping too)
    *[(how, stage) if (how, stage) != ("after DDP", 2) else pytest.param(how, stage, marks=pytest.mark.slow)
      for how in ("before DDP", "after DDP") for stage in (0, 1, 2)],
    ("whole DDP", 1), *[pytest.param("whole DDP", stage, marks=pytest.mark.slow) for stage in (0, 2)]])
def test_compiled_tp_blocks_inside_ddp_and_zero_train_like_one_process(compiled, zero_stage):
    """As a library user composes it: the GPT under DModule TP+SP, each block compiled, wrapped in
    ndweave's DDP (all-reduce, or laid out for the DistributedOptimizer: ZeRO-1 and ZeRO-2) on DP=2 x
    TP=2, AdamW steps against one process in float64; one graph for every block, no break, and
    nothing compiled again after the step that compiled. (Dynamo fakes every parameter and its ``.grad``:
    DDP's grads and ZeRO's parameters live in flat buffers, as DTensors over their memory.) Or the
    wrapper compiled whole (``torch.compile(ddp)``): one graph, compiled by the second step (the
    first runs DModule's first call eagerly), nothing after it."""
    run_distributed(_tp_ddp_zero_compiled, 4, zero_stage, compiled, timeout=600)


def _tp_ddp_zero_compiled(zero_stage: int, how: str) -> None:
    import copy

    from ndweave.ddp import DDP
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan
    from ndweave.mesh import init_device_mesh
    from ndweave.mesh.testing import train_one_process
    from ndweave.mesh.torch_compat import compile_counts, reset_compile_counts
    from ndweave.optim import BasicOptimizer, DistributedOptimizer
    from ndweave_gpt.models.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    reference = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)).double()
    generator = torch.Generator().manual_seed(0)
    batches = [(ids, ids) for ids in torch.randint(0, 64, (4, 4, 16), generator=generator)]  # 4 steps of 4 rows
    adamw = {"lr": 1e-2, "eps": 1e-4, "foreach": False}
    expected = train_one_process(reference, batches, optimizer=lambda ps: torch.optim.AdamW(ps, **adamw),
                                 model_loss=lambda m, x, y: m(x, y)[1], copy_model=True, keep_params="every")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    model = copy.deepcopy(reference)
    model = parallelize_module(model, mesh["TP"], get_plan("nanogpt", model, sequence_parallel=True))
    torch.compiler.reset()  # (a pooled rank may have compiled this code for an earlier test)
    blocks = model.transformer.h
    if how == "before DDP":
        for block in blocks:
            block.compile()
    model = DDP(model, mesh["DP"], zero_stage=zero_stage, bucket_size=4_000)  # (several buckets)
    if how == "after DDP":
        for block in blocks:
            block.compile()
    forward = torch.compile(model) if how == "whole DDP" else model
    optimizer = (DistributedOptimizer(torch.optim.AdamW, models=[model], optimizer_kwargs=adamw) if zero_stage
                 else BasicOptimizer(torch.optim.AdamW(model.parameters(), **adamw), models=[model]))
    dp = mesh["DP"].get_local_rank()
    for step, (ids, _) in enumerate(batches):
        rows = ids.chunk(2)[dp]
        reset_compile_counts()
        _, loss = forward(rows, rows)
        loss.backward()
        counts = compile_counts()
        optimizer.step()
        optimizer.zero_grad()
        if how == "whole DDP":  # (step 0 breaks at DModule's eager first call, step 1 recompiles past it)
            assert (counts.frames > 0) == (step < 2) and (not counts.graph_breaks or step == 0), f"step {step}: {counts}"
            assert counts.graphs == (1 if step == 1 else 0), f"step {step}: {counts}"
        else:
            assert (counts.frames > 0) == (step == 1) and not counts.graph_breaks, f"step {step}: {counts}"
            assert counts.graphs == (1 if step == 1 else 0) and not counts.recompiles, f"step {step}: {counts}"
        for name, p in model.module.named_parameters():
            assert_close(p.full_tensor(), expected.params[step][name], name=f"step {step} {name}")


@pytest.mark.parity
@pytest.mark.parametrize(("adapter", "zero_stage"), [("lora", 1), pytest.param(None, 2, marks=pytest.mark.slow)])
def test_transformers_layers_compiled_after_ddp_train_like_one_process(adapter, zero_stage):
    """A transformers Llama (with PEFT LoRA adapters on every linear: the base frozen) under the auto
    plan's TP+SP, wrapped in DDP on DP=2 x TP=2 and then each decoder layer compiled in place: AdamW
    steps equal one process's to ``FLOAT32_INSIDE``, with no graph break and nothing compiled after
    the second step. (With LoRA the first layer compiles apart: its input, the frozen embedding's
    output, needs no grad.)"""
    pytest.importorskip("transformers")
    if adapter:
        pytest.importorskip("peft")
    run_distributed(_transformers_compiled_after_ddp, 4, adapter, zero_stage, timeout=600)


def _transformers_compiled_after_ddp(adapter: str | None, zero_stage: int) -> None:
    import copy

    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from ndweave.ddp import DDP
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan
    from ndweave.mesh import init_device_mesh
    from ndweave.mesh.testing import STRICT_DTYPE, train_one_process
    from ndweave.mesh.torch_compat import compile_counts, reset_compile_counts
    from ndweave.optim import DistributedOptimizer

    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    if adapter == "lora":
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        reference = peft.get_peft_model(reference, config)
    generator = torch.Generator().manual_seed(0)
    batches = [(ids[:, :-1], ids[:, 1:]) for ids in torch.randint(0, 128, (3, 4, 17), generator=generator)]
    adamw = {"lr": 1e-2, "eps": 1e-4, "foreach": False}

    def loss_of(model, inputs, targets):  # (the loss outside the model, against plain targets)
        return F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())

    expected = train_one_process(reference, batches, optimizer=lambda ps: torch.optim.AdamW(ps, **adamw),
                                 model_loss=loss_of, copy_model=True, keep_params="every")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    model = copy.deepcopy(reference)
    model = parallelize_module(model, mesh["TP"], get_plan("auto", model, sequence_parallel=True))
    torch.compiler.reset()  # (a pooled rank may have compiled these classes for an earlier test)
    model = DDP(model, mesh["DP"], zero_stage=zero_stage, bucket_size=4_000)  # (several buckets)
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    for layer in layers:
        layer.compile()
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=[model], optimizer_kwargs=adamw)
    dp = mesh["DP"].get_local_rank()
    for step, (inputs, targets) in enumerate(batches):
        reset_compile_counts()
        loss_of(model, inputs.chunk(2)[dp], targets.chunk(2)[dp]).backward()
        counts = compile_counts()
        optimizer.step()
        optimizer.zero_grad()
        assert (counts.frames > 0) == (step == 1) and not counts.graph_breaks, f"step {step}: {counts}"
        assert counts.graphs <= (2 if step == 1 else 0), f"step {step}: {counts}"
        for name, p in model.module.named_parameters():
            assert_close(p.full_tensor(), expected.params[step][name], name=f"step {step} {name}", tol=FLOAT32_INSIDE)
