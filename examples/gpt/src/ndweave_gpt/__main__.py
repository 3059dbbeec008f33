"""ndweave's main job: a GPT trained on Shakespeare (bytes) with pipeline x data x tensor(+sequence)
parallelism and a ZeRO optimizer over one device mesh, checkpointed, resumable on any other mesh.

    hatch run train                                          # 8 CPU ranks: pp=2,dp=2,tp=2
    python -m ndweave_gpt --mesh dp=4 --resume               # continue the same run on 4 ranks
    hatch run train --mesh pp=2,dp=2,ep=2 --moe-experts 4    # MoE blocks, experts over EP (8 ranks)
    hatch run train --model hf:qwen2 --config small          # a transformers model (the zoo's plan, else auto)
    hatch run train --init-from llama-dir --export-hf out    # fine-tune a transformers folder, write it back
    hatch run train --mesh pp=2,dp=4 --estimate              # each rank's peak memory, nothing launched
    torchrun --nproc-per-node 8 -m ndweave_gpt --mesh pp=2,dp=-1,tp=2 --device cuda
    torchrun --nnodes=1:4 --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ndweave_gpt --mesh pp=2,dp=-1,tp=2 --resume      # elastic: restarts resume, any 4k ranks

Run without torchrun, the job starts itself under torchrun (``--standalone``) with as many processes as
``--mesh`` names. The composition, one function per concern (``ndweave_gpt.build``): ``ndweave.mesh``
(the mesh) -> ``ndweave.dmodule`` (the zoo's TP+SP plan for the model, or auto) -> ``ndweave.pipeline``
(stages by FQN, ``PipeEngine``) -> ``ndweave.ddp`` -> ``ndweave.optim`` (``DistributedOptimizer``) ->
``ndweave.checkpoint`` (``CheckpointManager``, ``DataPosition``); see ``build.parallelize`` for the
order the model is built in.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ndweave.mesh import resolve_spec, shutdown
from ndweave.mesh.elastic import lost_ranks
from ndweave_gpt import cost, report
from ndweave_gpt.config import DIMS, JobConfig, parse_args
from ndweave_gpt.export_hf import export_hf
from ndweave_gpt.loop import train
from ndweave_gpt.reference import train_single_device

__all__ = ["main", "parse", "relaunch_under_torchrun"]


def parse(argv: list[str] | None = None) -> JobConfig:
    """The job's config from its command line (``--help``: this module's docstring, then every flag)."""
    return parse_args(argv, description=__doc__)


def relaunch_under_torchrun(config: JobConfig, argv: list[str]) -> None:
    """Not started by torchrun: start the job again under it (``-m ndweave_gpt``), one process per mesh rank."""
    try:
        world = math.prod(resolve_spec(config.parallel.mesh, None, dims=DIMS).values())
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    if config.parallel.device == "cuda" and world > torch.cuda.device_count():
        raise SystemExit(f"--mesh {config.parallel.mesh} needs {world} GPUs, {torch.cuda.device_count()} are visible")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "ndweave_gpt", *argv]
    os.execv(sys.executable, command)


@record  # under torchrun: the failing rank's traceback in torchrun's summary, naming the root cause
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = parse(argv)
    if config.parallel.mesh == "auto":  # planned here, once, before any launch: the ranks get the chosen flags
        argv = cost.plan_mesh(config, argv)
        config = parse(argv)
    if config.plan.estimate:  # before any launch: one process, nothing allocated
        try:
            print(cost.estimate.table(cost.memory_estimate(config)))
        except (NotImplementedError, ValueError) as error:  # a layout it cannot estimate (yet), or a bad spec
            raise SystemExit(f"error: --estimate: {error}") from None
        return 0
    if "TORCHELASTIC_RUN_ID" not in os.environ and "RANK" not in os.environ:
        relaunch_under_torchrun(config, argv)
    try:
        result = train(config)
    except Exception:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            raise
        timeout = config.parallel.timeout
        rank, lost = dist.get_rank(), lost_ranks(timeout)  # a peer gone (torchrun restarts the job), or a bug
        shutdown(abort=True)  # the others' shutdown() names this rank and its error; no wait
        if lost == []:
            raise
        what = f"rank(s) {lost}" if lost else "a peer, and the store with it (its node is gone)"
        print(f"rank {rank}: lost {what} within --timeout {timeout:g}s; exiting so that torchrun can restart "
              "the job", file=sys.stderr)
        return 1
    rank = dist.get_rank()
    shutdown()  # every rank done, the work in flight finished, the groups gone: the process exits 0
    ok = True
    if rank == 0:  # single-process work from here on, so the others need not wait (nor time out)
        report.finish(result, config)
        if config.plan.memory_check:
            report.memory_check(result.tensor_peak, cost.memory_estimate(config))
        if config.metrics.compare_single_device:
            ok = report.compare(result, config, lambda k, last: train_single_device(config, k, last))
        if result.sample:
            report.sample(result.sample)
        if config.checkpoint.export_hf:  # the last checkpoint this run wrote, as a transformers folder
            print(f"transformers checkpoint: {export_hf(config.checkpoint.checkpoint_dir, config.checkpoint.export_hf)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
