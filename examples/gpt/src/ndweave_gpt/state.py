"""What a checkpoint holds, and resuming from one: the model chunks, the optimizer and its lr schedule,
the data position (with ``--data``, the data's hash too), the step, the RNG and every step's loss so far
(so a resumed run's plot shows the whole curve); written by ``ndweave.checkpoint.CheckpointManager``,
readable on any other mesh.

    run = open_run(chunks, optimizer, scheduler, config, rank)   # resumed if --resume says so
    ... train steps run.start + 1 .. ; run.save(step)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ndweave.checkpoint import CheckpointManager, DataPosition
from ndweave.mesh.elastic import restart_count
from ndweave_gpt.config import DTYPES, JobConfig
from ndweave_gpt.faults import FaultInjection
from ndweave_gpt.metrics import say
from ndweave_gpt.models import hf

__all__ = ["Run", "open_run", "resize_history", "resume_changes", "resume_mode", "save_config", "settings"]


@dataclass
class Run:
    """One run's checkpointed state on this rank, and where it is saved."""

    state: dict
    """What every checkpoint holds (``CheckpointManager.save``'s state)."""
    manager: CheckpointManager
    position: DataPosition
    """The global data stream's position (samples read), the same at every mesh."""
    fault: FaultInjection
    start: int = 0
    """The last step trained before this run (0: a fresh start)."""

    @property
    def history(self) -> list[float]:
        """Every step's loss since the run began (NaN: not trained yet)."""
        return self.state["loss_history"]

    @property
    def val_history(self) -> list[float]:
        """Every step's validation loss (NaN: none)."""
        return self.state["val_history"]

    def save(self, step: int) -> None:
        """A checkpoint of step ``step`` (collective: every rank)."""
        self.state["step"], self.state["rng"] = step, torch.get_rng_state()
        self.manager.save(step, self.state)


def settings(config: JobConfig) -> dict:
    """The settings a checkpoint records, which a resumed run may change (and says so)."""
    return {"global_batch": config.data.global_batch, "lr": config.training.lr, "steps": config.training.steps}


def open_run(chunks: list[nn.Module], optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
             config: JobConfig, rank: int, show: bool = False, data_hash: str | None = None) -> Run:
    """The run's state, loaded from the newest complete checkpoint where :func:`resume_mode` says so;
    ``show``: say what was resumed (rank 0). ``data_hash`` (``--data``: ``TokenData.fingerprint``) is
    saved with it; a checkpoint of other data or another tokenizer is refused naming both hashes,
    unless ``--allow-data-change``."""
    steps = config.training.steps
    fault = FaultInjection(config.faults, rank)
    # lists, not tensors: a checkpoint's history replaces them whole, so a resumed run may go on longer
    # (or shorter) than the run that wrote it
    state = {"model": chunks, "optimizer": optimizer, "scheduler": scheduler, "data": DataPosition(), "step": 0,
             "rng": torch.get_rng_state(), "loss_history": [math.nan] * steps, "val_history": [math.nan] * steps,
             "settings": settings(config)}
    if config.model.hf_config is not None:  # what export_hf needs to write a transformers folder from any step
        state["hf_config"] = hf.config_json(config.model.hf_config, DTYPES[config.model.dtype])
    if data_hash is not None:  # what the position counts samples of
        state["data_hash"] = data_hash
    if config.faults.kill_rank is not None:  # its state_dict() runs inside every save: where --kill-in-save strikes
        state["fault_injection"] = fault
    directory = config.checkpoint.checkpoint_dir
    run = Run(state, CheckpointManager(directory, keep_last=2), state["data"], fault)
    if rank == 0:
        save_config(config)
    if not resume_mode(config):
        return run
    run.start = run.manager.load_latest(state) or 0
    if run.start > steps:  # the same checkpoint on every rank: the same verdict
        raise SystemExit(f"error: the checkpoint in {directory} is at step {run.start}, past --steps "
                         f"{steps}: pass --steps {run.start} or more to continue it, or another --checkpoint-dir")
    if data_hash is not None and state["data_hash"] != data_hash:
        if not config.data.allow_data_change:
            raise SystemExit(f"error: the checkpoint in {directory} was trained on other data or another tokenizer: "
                             f"its data hash is {state['data_hash']}, this run's {data_hash} (--data, --tokenizer, "
                             "--packing, --block-size); pass the same, another --checkpoint-dir, or "
                             "--allow-data-change to continue on this data from the checkpoint's position")
        if show:
            say(f"resumed on other data (--allow-data-change): the checkpoint's {state['data_hash']}, now {data_hash}")
        state["data_hash"] = data_hash
    torch.set_rng_state(state["rng"])
    # a longer --steps extends the run: the history grows, the lr schedule stretches to the new end
    for key in ("loss_history", "val_history"):
        state[key] = resize_history(state[key], steps)
    changes = resume_changes(state, scheduler, config)
    if show:
        for change in changes:
            say(f"resumed with {change}")
        restarted = f" (torchrun restart {restart_count()}, {dist.get_world_size()} ranks)" if restart_count() else ""
        say(f"resumed from step {run.start} of {run.manager.path(run.start)}{restarted}" if run.start
            else "no checkpoint: fresh start")
    return run


def save_config(config: JobConfig) -> None:
    """The run's whole config as ``config.json`` beside its checkpoints (rank 0; a resumed run's replaces it)."""
    directory = config.checkpoint.checkpoint_dir
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write(config.to_json() + "\n")


def resume_mode(config: JobConfig) -> bool:
    """Whether to load the newest checkpoint: ``--resume always``/``never``, or under ``auto`` when
    torchrun restarted the job on any rank (a node restarted for another's failure counts none)."""
    if config.checkpoint.resume != "auto":
        return config.checkpoint.resume == "always"
    restarted = torch.tensor([restart_count()])
    dist.all_reduce(restarted, op=dist.ReduceOp.MAX)
    return restarted.item() > 0


def resume_changes(state: dict, scheduler: torch.optim.lr_scheduler.LambdaLR, config: JobConfig) -> list[str]:
    """Settings this run changes from the checkpoint's (allowed: the data position counts samples, the
    schedule is recomputed): the new ones take effect from the next step; what changed, in words."""
    saved, now = state["settings"], settings(config)
    changes = [f"--{key.replace('_', '-')} {value} (the checkpoint's run had {saved[key]})"
               for key, value in now.items() if saved.get(key, value) != value]
    scheduler.base_lrs = [config.training.lr] * len(scheduler.base_lrs)  # the schedule's peak is this run's --lr
    # the next step's lr from this run's schedule: the optimizer's checkpoint holds the lr the old
    # schedule (another --steps or --lr) set for it
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    state["settings"] = now
    return changes


def resize_history(history: list[float], steps: int) -> list[float]:
    """A checkpoint's per-step history for a run of ``steps`` (NaN: not trained yet)."""
    return list(history[:steps]) + [math.nan] * (steps - len(history))
