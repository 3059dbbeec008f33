"""The job on this rank: build it (:mod:`~ndweave_gpt.build`), open or resume its run
(:mod:`~ndweave_gpt.state`), train (:func:`loop`), and say what it did (:class:`~ndweave_gpt.result.RunResult`)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ndweave.mesh import ParallelMesh
from ndweave.mesh.torch_compat import (compile_counts, group_timeout, live_groups, reset_compile_counts,
                                       set_group_timeout)
from ndweave_gpt import report
from ndweave_gpt.build import (Parallel, attending, build_data, build_mesh, build_model, build_optimizer, check_mesh,
                               context_batch, data_mean, data_rank, first_step_timeout, global_tokens, loss_scale,
                               parallelize, to_device)
from ndweave_gpt.config import DIMS, JobConfig
from ndweave_gpt.data import TextData
from ndweave_gpt.data.tokens import TokenData
from ndweave_gpt.evaluate import sample, validation_loss
from ndweave_gpt.metrics import Sinks, open_sinks, say, step_row
from ndweave_gpt.result import RunResult, by_step, gather_params, peak_memory
from ndweave_gpt.state import Run, open_run

__all__ = ["loop", "train"]


def train(config: JobConfig) -> RunResult:
    """The job on this rank (the default process group may exist already, as in the test harness);
    ``--memory-check``: every tensor tracked from before the model is built."""
    if not config.plan.memory_check:
        return _train(config, None)
    from ndweave.mesh.testing.memory import TensorMemory  # loaded only to measure (see torch_compat)

    with TensorMemory() as memory:
        return _train(config, memory)


def _train(config: JobConfig, memory: Any | None) -> RunResult:
    mesh = build_mesh(config)
    rank, world, device = dist.get_rank(), dist.get_world_size(), config.parallel.device
    check_mesh(mesh, config)
    model = build_model(config, "meta" if config.model.init_from else None)  # --init-from: each rank allocates its stage
    show = rank == 0 and not config.metrics.quiet
    if show:
        report.start(mesh, model, config)
    flops, peak = report.model_flops(model, config), report.device_peak_flops(config)  # MFU: on known GPUs only
    data = build_data(config, show)  # --data: rank 0 tokenizes once (cached), the others wait
    job = parallelize(model, mesh, config)
    # the stage chunks hold what this rank trains; the rest of the model goes, at once: the pipeline's
    # trace (torch.fx's tracer) leaves it in reference cycles, which only the cyclic collector frees
    del model
    gc.collect()
    job.optimizer, job.scheduler = build_optimizer(job.chunks, config)
    run = open_run(job.chunks, job.optimizer, job.scheduler, config, rank, show, getattr(data, "fingerprint", None))
    last, begin = config.training.last_step, time.perf_counter()
    sinks = open_sinks(config.metrics, run.start, last, rank)
    utilization = lambda tokens_per_s: report.mfu(flops, tokens_per_s, peak, world)  # noqa: E731
    losses, steps_peak, tokens = loop(config, mesh, job, run, data, sinks, utilization, memory, show)
    seconds = time.perf_counter() - begin
    sinks.close()
    # --data or cp: rank 0 samples after the run (sample_final): the pipeline's stages take a mask, or position ids
    # of a CP rank's tokens, which generation lacks
    through_pipeline = config.metrics.sample and not config.data.data and job.cp is None
    text = sample(job.engine, job.chunks, config, data) if through_pipeline else ""
    peaks: list[int] = [0] * world
    dist.all_gather_object(peaks, peak_memory(device))
    tensor_peaks: list[int] = [0] * world if memory is not None else []
    if memory is not None:
        dist.all_gather_object(tensor_peaks, steps_peak)
    tokens_per_s = tokens / max(seconds, 1e-9)
    shown = [d for d in DIMS if d not in ("CP", "EP") or mesh[d].size() > 1]  # CP, EP where the run has them
    return RunResult(losses, gather_params(job.chunks), seconds, tokens_per_s, peaks,
                     " x ".join(f"{d}={mesh[d].size()}" for d in shown), by_step(run.history),
                     by_step(run.val_history), text, utilization(tokens_per_s), tensor_peaks)


def report_compile(step: int, seconds: float) -> None:
    """--compile: a step that compiled says so, its time apart from the steps' (and a recompile, why:
    the input whose shape or dtype changed)."""
    counts = compile_counts()
    if counts.frames:
        breaks = sum(counts.graph_breaks.values())
        say(f"compile: step {step} compiled {counts.graphs} graph(s) in {seconds:.1f}s"
            + (f", {breaks} graph break(s): {'; '.join(counts.break_reasons())}" if breaks else "")
            + (f"; compiled again because {'; '.join(sorted(set(counts.recompiles)))}" if counts.recompiles else ""))


def last_compiling_step(config: JobConfig, start: int) -> int:
    """--compile: the step by which every graph is compiled: the run's first, or the first to evaluate
    (--eval-every: eval mode and no grad compile graphs of their own)."""
    every, last = config.data.eval_every, config.training.last_step
    return start + 1 if not every else max(start + 1, min(last, (start // every + 1) * every))


def settle_timeouts(config: JobConfig) -> None:
    """After the steps that compile (under --compile-timeout, as peers wait for a rank compiling): every
    group made with that timeout waits --timeout from now on (a group ndweave made with its own timeout
    keeps it). gloo's point-to-point receives keep the first timeout: gloo fixes it when it connects."""
    first, own = (timedelta(seconds=first_step_timeout(config.parallel)), timedelta(seconds=config.parallel.timeout))
    for group in live_groups():
        if first != own and group_timeout(group) == first:
            set_group_timeout(group, own)


def loop(config: JobConfig, mesh: ParallelMesh, job: Parallel, run: Run, data: TextData | TokenData, sinks: Sinks,
         utilization: Callable[[float], float | None], memory: Any | None = None,
         show: bool = False) -> tuple[dict[int, float], int, int]:
    """Train steps ``run.start + 1 .. --stop-at (or --steps)``: each step its batch through the pipeline,
    the optimizer step, maybe the validation loss, the metrics, maybe a checkpoint. Returns each
    step's global mean loss, (``memory``: a tensor tracker) the steps' peak of live tensor bytes, and the
    tokens they trained on (padding not counted)."""
    last, batch, device = config.training.last_step, config.data.global_batch, config.parallel.device
    eval_every, save_every = config.data.eval_every, config.checkpoint.checkpoint_every
    tokens, (dp_rank, dp_size) = batch * config.model.block_size, data_rank(mesh)
    losses, steps_peak, seen = {}, 0, 0
    compiled_by = last_compiling_step(config, run.start) if config.parallel.compile else None
    if memory is not None:
        memory.reset_peak()  # the steps' peak: what is live now (model state, data) and what they add
    for step in range(run.start + 1, last + 1):
        run.fault.before_step(step)
        if config.parallel.compile:
            reset_compile_counts()
        tick = time.perf_counter()
        x, y = context_batch(job.cp, *to_device(data.batch(run.position, batch, dp_rank, dp_size), device))
        reading = time.perf_counter() - tick
        if job.loss is not None:  # --data: the loss is the mean over the global batch's trained tokens
            trained, tokens = global_tokens(y, data.real_tokens, mesh)  # the bar counts tokens, not padding
            job.loss.scale = loss_scale(trained, mesh, config)
        seen += tokens
        job.optimizer.zero_grad()
        with attending(job.cp):
            loss = job.engine(x, y).detach().to(torch.float64)  # the mean over this rank's micro-batches
        job.optimizer.step()
        lr = job.optimizer.param_groups[0]["lr"]  # the one this step used
        job.scheduler.step()
        run.position.advance(batch)
        losses[step] = run.history[step - 1] = data_mean(loss, mesh)
        if eval_every and (step % eval_every == 0 or step == last):
            run.val_history[step - 1] = validation_loss(job, data, mesh, config)
        seconds = time.perf_counter() - tick
        if step == compiled_by:
            settle_timeouts(config)
        if config.parallel.compile and show:
            report_compile(step, seconds)
        sinks.write(step_row(step=step, loss=losses[step], val_loss=run.val_history[step - 1], lr=lr,
                             grad_norm=job.optimizer.last_grad_norm, seconds=seconds, tokens=tokens,
                             peak_bytes=peak_memory(device), mfu=utilization(tokens / seconds), data_seconds=reading))
        if memory is not None:
            steps_peak = max(steps_peak, memory.peak_bytes(device))
        if step == last or (save_every and step % save_every == 0):
            run.save(step)
            if memory is not None:  # a save's staging is the checkpoint's, not the step's
                memory.reset_peak()
            if show:
                say(f"checkpoint: step {step} -> {run.manager.path(step)}")
    return losses, steps_peak, seen
