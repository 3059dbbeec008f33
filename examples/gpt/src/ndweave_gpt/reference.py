"""``--compare-single-device``: the same run on this one process with plain torch, through the reference
loop every parity test uses (``ndweave.mesh.testing.train_one_process``); and, for a run in fp32 or
bf16, the parallel run again in float64 (:func:`float64_rerun`), which is what the verdict compares."""

from __future__ import annotations

import os

import torch
from torch import nn

from ndweave.checkpoint import DataPosition
from ndweave.mesh.testing import train_one_process
from ndweave_gpt.build import adamw_kwargs, build_data, build_model, init_weights, loss_fn, lr_schedule, to_device
from ndweave_gpt.config import JobConfig
from ndweave_gpt.evaluate import sample_one_process
from ndweave_gpt.models import hf
from ndweave_gpt.result import RunResult

__all__ = ["FLOAT64_RERUN_DIR", "float64_rerun", "train_single_device"]

#: where the float64 rerun writes its (discarded) checkpoint, under the run's --checkpoint-dir
FLOAT64_RERUN_DIR = "compare-float64"


def float64_rerun(config: JobConfig) -> JobConfig:
    """The run again in float64 on the same mesh, from step 1 to the same last step: what
    ``--compare-single-device`` holds to one process's float64 run, strictly, for a run in another dtype.

    An fp32 run's difference from one process is rounding the trajectory amplifies, by an amount no
    bound measured on one process predicts: the same fp32 job on one rank drifted 80x further from
    float64 than one-process fp32 runs summing in other orders did (the bound they set failed it),
    though in float64 it matched one process to 1e-15. In float64 a correct parallel run matches to
    ~1e-12 whatever the trajectory and a wrong one does not. It writes nothing the run keeps: no
    metrics, plot, sample or faults, its checkpoint in :data:`FLOAT64_RERUN_DIR` (removed after)."""
    checkpoints = config.checkpoint.checkpoint_dir
    return config.replace(dtype="float64", resume="never", checkpoint_every=0, export_hf="", eval_every=0,
                          checkpoint_dir=os.path.join(checkpoints, FLOAT64_RERUN_DIR),
                          data_cache=config.data.data_cache or os.path.join(checkpoints, "prepared"),
                          jsonl="", tensorboard="", plot="", sample=0, quiet=True, memory_check=False,
                          kill_rank=None, kill_in_save=False)


def train_single_device(config: JobConfig, micro_batches: int = 1, last: int | None = None,
                        model: nn.Module | None = None, extended_from: int | None = None) -> RunResult:
    """The run on this one process (AdamW, clip_grad_norm_, the same lr schedule and data);
    ``micro_batches > 1`` accumulates each batch's gradient in that many parts: the same math, summed in
    another order. bf16 parameters get fp32 masters, as in the parallel run. ``model``: start from it
    (e.g. what transformers' ``from_pretrained`` loads), else from the job's model and --init-from.
    ``extended_from``: the run was written with that --steps and resumed with this longer one there
    (``--resume --steps N``): the shorter lr schedule until then (:func:`~ndweave_gpt.build.lr_schedule`)."""
    device, batch, eval_every = config.parallel.device, config.data.global_batch, config.data.eval_every
    if model is None:
        model = build_model(config)
        if config.model.init_from:
            init_weights([model], hf.tied_aliases(model), config)
    data, position = build_data(config), DataPosition()  # --data: the shards the run prepared (cached)
    end = last or config.training.steps
    val_losses: dict[int, float] = {}

    def batches():
        for _ in range(end):
            yield to_device(data.batch(position, batch), device)
            position.advance(batch)

    def validate(index: int, model: nn.Module) -> None:
        step = index + 1
        if eval_every and (step % eval_every == 0 or step == end):
            with torch.no_grad():
                vx, vy = to_device(data.validation(batch), device)
                val_losses[step] = loss_fn((model(**vx) if isinstance(vx, dict) else model(vx))[0], vy).item()

    run = train_one_process(model, batches(), optimizer=lambda params: torch.optim.AdamW(params, **adamw_kwargs(config)),
                            loss_fn=lambda output, y: loss_fn(output[0], y), micro_batches=micro_batches,
                            clip=config.training.clip, fp32_masters=True, on_step=validate,
                            scheduler=lambda opt: lr_schedule(opt, config, extended_from))
    losses = {step: loss for step, loss in enumerate(run.losses, start=1)}
    final = {n: p.cpu() for n, p in run.final.items()}
    text = sample_one_process(model, config, data) if config.metrics.sample else ""
    return RunResult(losses, final, val_losses=val_losses, sample=text)
