"""ndweave's main job: a GPT trained on Shakespeare (bytes) with pipeline x data x tensor(+sequence)
parallelism and a ZeRO optimizer over one device mesh, checkpointed, resumable on any other mesh.

    hatch run train                                          # 8 CPU ranks: pp=2,dp=2,tp=2
    python -m ndweave_gpt --mesh dp=4 --resume               # continue the same run on 4 ranks
    hatch run train --mesh pp=2,dp=2,ep=2 --moe-experts 4    # MoE blocks, experts over EP (8 ranks)
    hatch run train --model hf:qwen2 --config small          # a transformers model (the zoo's plan, else auto)
    hatch run train --init-from llama-dir --export-hf out    # fine-tune a transformers folder, write it back
    hatch run train --init-from llama-dir --data my.jsonl    # ... on your text, with its tokenizer (packed)
    hatch run train --mesh pp=2,dp=4 --estimate              # each rank's peak memory, nothing launched
    torchrun --nproc-per-node 8 -m ndweave_gpt --mesh pp=2,dp=-1,tp=2 --device cuda
    torchrun --nnodes=1:4 --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ndweave_gpt --mesh pp=2,dp=-1,tp=2 --resume      # elastic: restarts resume, any 4k ranks

Run without torchrun, the job starts itself under torchrun (``--standalone``) with as many processes as
``--mesh`` names, and a failing run ends in one line naming the rank, what failed and the fix
(``--verbose``: torch's launcher report too). ``--mesh auto`` is planned once: in the launching
process, or under torchrun by rank 0, which hands its choice to the others.

The composition, one function per concern (``ndweave_gpt.build``): ``ndweave.mesh``
(the mesh) -> ``ndweave.dmodule`` (the zoo's TP+SP plan for the model, or auto) -> ``ndweave.pipeline``
(stages by FQN, ``PipeEngine``) -> ``ndweave.ddp`` -> ``ndweave.optim`` (``DistributedOptimizer``) ->
``ndweave.checkpoint`` (``CheckpointManager``, ``DataPosition``); see ``build.parallelize`` for the
order the model is built in.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ndweave.mesh import resolve_spec, shutdown
from ndweave.mesh.elastic import lost_ranks, restart_count
from ndweave_gpt import cost, report
from ndweave_gpt.config import DIMS, JobConfig, parse_args
from ndweave_gpt.evaluate import sample_final
from ndweave_gpt.export_hf import export_hf
from ndweave_gpt.loop import train
from ndweave_gpt.reference import float64_rerun, train_single_device

__all__ = ["main", "parse", "plan_once", "relaunch_under_torchrun"]

#: The folder the relaunching process gives its ranks for their failure records (a JSON file per failed rank).
FAILURES_ENV = "NDWEAVE_GPT_FAILURES"
#: How long ranks wait for rank 0's ``--mesh auto`` plan (a large model's takes minutes, not the --timeout).
PLAN_WAIT = timedelta(hours=1)


def parse(argv: list[str] | None = None) -> JobConfig:
    """The job's config from its command line (``--help``: this module's docstring, then every flag)."""
    return parse_args(argv, description=__doc__)


def relaunch_under_torchrun(config: JobConfig, argv: list[str]) -> int:
    """Not started by torchrun: run the job again under it (``-m ndweave_gpt``), one process per mesh rank,
    through torchrun's own entry (``torch.distributed.run.run``) in this process. Returns the exit code;
    a failure ends in one line, ``error: rank R: what failed; the fix``, from the failed ranks' records
    (``--verbose``: after torchrun's logs and its ChildFailedError report)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        world = math.prod(resolve_spec(config.parallel.mesh, None, dims=DIMS).values())
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    if config.parallel.device == "cuda" and world > torch.cuda.device_count():
        raise SystemExit(f"--mesh {config.parallel.mesh} needs {world} GPUs, {torch.cuda.device_count()} are visible")
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={world}", "-m", "ndweave_gpt", *argv])
    folder = os.environ[FAILURES_ENV] = tempfile.mkdtemp(prefix="ndweave_gpt_failures_")
    if not config.metrics.verbose:  # this process only launches: its logs are torch's launcher's
        logging.disable(logging.CRITICAL)
    try:
        torchrun.run(args)
        return 0
    except ChildFailedError as error:
        if config.metrics.verbose:
            print(f"{type(error).__name__}: {error}", file=sys.stderr)
        print(failure_line(folder, error), file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def failure_line(folder: str, error: Exception) -> str:
    """The one line a failed launch ends in: the first rank to fail (the root cause; its peers fail after
    it), by the ranks' records in ``folder`` and the ranks torchrun saw killed by a signal (no record)."""
    failed = []  # (time, rank, what)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as file:
            record = json.load(file)
        failed.append((record["time"], record["rank"], record["what"]))
    recorded = {rank for _, rank, _ in failed}
    for rank, failure in getattr(error, "failures", {}).items():
        if rank in recorded or failure.exitcode >= 0 or -failure.exitcode in (signal.SIGTERM, signal.SIGINT):
            continue  # SIGTERM: torchrun stopping the others after a failure
        name = signal.Signals(-failure.exitcode).name
        what = f"killed by {name}; out of memory? see its output above, and --estimate for each rank's peak memory"
        failed.append((failure.timestamp, rank, what))
    if failed:
        _, rank, what = min(failed)
        return f"error: rank {rank}: {what}"
    rank, failure = error.get_first_failure()  # type: ignore[attr-defined]
    return (f"error: rank {rank}: exited with code {failure.exitcode}; see its output above (--verbose: "
            "torchrun's report)")


def record_failure(what: str) -> None:
    """Under :func:`relaunch_under_torchrun`: this rank's failure as one line (what failed; the fix) for the
    launching process. The first record a rank writes is kept."""
    folder = os.environ.get(FAILURES_ENV)
    if not folder or not os.path.isdir(folder):
        return
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(folder, f"rank{rank}.json")
    if os.path.exists(path):
        return
    with open(path, "w") as file:
        json.dump({"rank": rank, "time": time.time(), "what": what}, file)


def _failure(error: BaseException) -> str | None:
    """An exception as a failure record's line (None: a clean exit)."""
    if isinstance(error, SystemExit):
        if error.code in (0, None):
            return None
        if isinstance(error.code, int):
            return f"exited with code {error.code}; its message is above"
        return str(error.code).removeprefix("error: ")
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return f"{type(error).__name__}: {error}; its traceback is above (--verbose: torchrun's report)"


def plan_once(config: JobConfig, argv: list[str], plan: Callable[[JobConfig, list[str]], list[str]] | None = None
              ) -> list[str]:
    """``--mesh auto``, planned by one process: ``argv`` with the chosen layout's flags. Before launch,
    here; under torchrun (or the test harness), rank 0 plans and prints, and every other rank takes its
    flags (over torchrun's store, or the default group where one exists), so that every rank runs the
    same layout whatever it would have measured itself. ``plan``: ``cost.plan_mesh``, which needs a process
    with no process group yet (it prices layouts in ``fake_world``): where one exists, rank 0's failure
    to plan is what every rank reports."""
    plan = plan or cost.plan_mesh
    if not dist.is_initialized() and "RANK" not in os.environ:
        return plan(config, argv)
    if dist.is_initialized() and not config.plan.world_size:
        config = config.replace(world_size=dist.get_world_size())  # what WORLD_SIZE says under torchrun
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    publish, receive = _rank_zero_channel(rank)
    if rank != 0:
        outcome = receive()
    else:
        try:
            outcome = {"argv": plan(config, argv)}
        except BaseException as error:  # the others would wait for a plan: they get the failure instead
            publish({"error": f"--mesh auto: rank 0 failed to plan: {_failure(error)}"})
            raise
        publish(outcome)
    if "error" in outcome:
        raise SystemExit(f"error: {outcome['error']}")
    return outcome["argv"]


def _rank_zero_channel(rank: int) -> tuple[Callable[[dict], None], Callable[[], dict]]:
    """``(publish, receive)``: rank 0 publishes one JSON-able object, every other rank receives it."""
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=PLAN_WAIT)

        def broadcast(box: list) -> dict:
            dist.broadcast_object_list(box, src=0, group=group)
            return box[0]

        return (lambda outcome: broadcast([outcome]) and None), lambda: broadcast([None])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise SystemExit("error: --mesh auto needs torchrun's store to share the plan: start the job with "
                         "python -m ndweave_gpt or torchrun, or pass the concrete --mesh")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=PLAN_WAIT)
    key = f"ndweave_gpt/mesh_auto/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{restart_count()}"
    return (lambda outcome: store.set(key, json.dumps(outcome))), lambda: json.loads(store.get(key))


@record  # under torchrun: the failing rank's traceback in torchrun's summary, naming the root cause
def main(argv: list[str] | None = None) -> int:
    """The job; on a rank started by :func:`relaunch_under_torchrun`, a failure also leaves its record."""
    try:
        code = _main(argv)
    except BaseException as error:
        what = _failure(error)
        if what is not None:
            record_failure(what)
        raise
    if code:
        record_failure(f"exited with code {code}; see its output above")  # unless it said more already
    return code


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = parse(argv)
    if config.parallel.mesh == "auto":  # planned once, by one process: every rank gets the chosen flags
        argv = plan_once(config, argv)
        config = parse(argv)
    if config.plan.estimate:  # before any launch: one process, nothing allocated
        try:
            print(cost.estimate.table(cost.memory_estimate(config)))
        except (NotImplementedError, ValueError) as error:  # a layout it cannot estimate (yet), or a bad spec
            raise SystemExit(f"error: --estimate: {error}") from None
        return 0
    if "TORCHELASTIC_RUN_ID" not in os.environ and "RANK" not in os.environ:
        return relaunch_under_torchrun(config, argv)
    try:
        result = train(config)
        # the verdict of --compare-single-device for a run in another dtype: the same run in float64
        float64_parallel = train(float64_rerun(config)) if config.metrics.compare_single_device and \
            config.model.dtype != "float64" else None
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
        record_failure(f"lost {what} within --timeout {timeout:g}s; launch with torchrun --max-restarts N "
                       "(and --checkpoint-every) to resume from the last checkpoint")
        return 1
    rank = dist.get_rank()
    shutdown()  # every rank done, the work in flight finished, the groups gone: the process exits 0
    ok = True
    if rank == 0:  # single-process work from here on, so the others need not wait (nor time out)
        report.finish(result, config)
        if config.plan.memory_check:
            report.memory_check(result.tensor_peak, cost.memory_estimate(config))
        if config.metrics.compare_single_device:
            ok = report.compare(result, config,
                                lambda k, last, dtype: train_single_device(config.replace(dtype=dtype), k, last),
                                float64_parallel)
            shutil.rmtree(float64_rerun(config).checkpoint.checkpoint_dir, ignore_errors=True)
            if not ok:
                record_failure("--compare-single-device: FAIL, the parallel run differs from one process in "
                               "float64 beyond the strict tolerance (the table above): a bug, not rounding")
        if config.metrics.sample and not result.sample:  # (--data, cp: the pipeline did not sample)
            result.sample = sample_final(result.params, config)
        if result.sample:
            report.sample(result.sample)
        if config.checkpoint.export_hf:  # the last checkpoint this run wrote, as a transformers folder
            out = export_hf(config.checkpoint.checkpoint_dir, config.checkpoint.export_hf, config.data.tokenizer or None)
            print(f"transformers checkpoint: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
