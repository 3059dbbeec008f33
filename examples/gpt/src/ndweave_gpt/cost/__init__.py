"""The job's cost model, before launch: nothing started, nothing allocated (the model on meta).

* :mod:`~ndweave_gpt.cost.estimate`: each rank's peak memory for a layout (``--estimate``);
* :mod:`~ndweave_gpt.cost.step_time`: one step's seconds on a calibrated machine;
* :mod:`~ndweave_gpt.cost.proxy`: both, for many layouts, from three traced parts of the model;
* :mod:`~ndweave_gpt.cost.auto_mesh`: ``--mesh auto``, the fastest layout that fits;
* :mod:`~ndweave_gpt.cost.on_paper`: the planner on published runs (``python -m ndweave_gpt.cost.on_paper``).

This module wires them to the job's own model, plan, loss and optimizer (:mod:`ndweave_gpt.build`):

    print(estimate.table(memory_estimate(config)))       # --estimate
    argv = plan_mesh(config, argv)                        # --mesh auto: the chosen layout's flags
"""

from __future__ import annotations

from ndweave.ddp import DEFAULT_BUCKET_SIZE
from ndweave.mesh import resolve_spec
from ndweave.plan.calibrate import Machine, calibrate
from ndweave.plan.estimate import RankMemory
from ndweave.plan.layouts import Planned
from ndweave_gpt.build import adamw_kwargs, build_model, loss_fn, mesh_problem, sharding_plan
from ndweave_gpt.config import DIMS, DTYPES, JobConfig, num_experts
from ndweave_gpt.cost import auto_mesh, estimate, proxy, step_time

__all__ = ["auto_mesh", "choose_layout", "estimate", "memory_estimate", "plan_mesh", "pricer", "proxy", "step_time"]


def memory_estimate(config: JobConfig) -> list[RankMemory]:
    """Each rank's estimated peak memory for ``--mesh`` (:mod:`~ndweave_gpt.cost.estimate`), in rank order."""
    return estimate.estimate_memory(config, build_model, lambda model, sizes: sharding_plan(model, config, sizes),
                                    loss_fn, DEFAULT_BUCKET_SIZE, adamw_kwargs(config))


def pricer(config: JobConfig, machine: Machine) -> proxy.Pricer:
    """Prices the job's layouts on ``machine`` from three traced parts of its model (:mod:`~ndweave_gpt.cost.proxy`)."""
    return proxy.Pricer(config, machine, build_model, lambda model, sizes: sharding_plan(model, config, sizes),
                        loss_fn, DEFAULT_BUCKET_SIZE, adamw_kwargs(config))


def choose_layout(config: JobConfig, priced: proxy.Pricer, world: int, budget: int, experts: int | None = None) -> Planned:
    """The fastest layout of ``world`` ranks whose every rank fits ``budget`` bytes, priced by ``priced``,
    less what the job refuses (:func:`~ndweave_gpt.build.mesh_problem`)."""
    experts = num_experts(config) if experts is None else experts
    return auto_mesh.choose_layout(
        config, auto_mesh.model_shape(priced.model, config, experts), world, budget,
        peak_bytes=priced.peak_bytes, step_seconds=priced.step_seconds, price_ahead=priced.price_ahead,
        job_rule=lambda a: mesh_problem(a, resolve_spec(a.parallel.mesh, None, dims=DIMS)))


def plan_mesh(config: JobConfig, argv: list[str]) -> list[str]:
    """``--mesh auto``: the fastest layout that fits (:mod:`~ndweave_gpt.cost.auto_mesh`), its table printed;
    ``argv`` with the chosen layout's flags in place of the mesh and schedule flags."""
    world = auto_mesh.world_size(config)
    budget = auto_mesh.memory_per_device(config, world)
    # every layout priced from three traced parts of the model (proxy.py), not a trace of it each
    machine = calibrate(config.parallel.device, dtypes=[DTYPES[config.model.dtype]])
    planned = choose_layout(config, pricer(config, machine), world, budget)
    print(f"--mesh auto: {world} ranks, {budget / 2**30:.2f} GiB each\n{planned.table()}")
    if planned.best is None:
        raise SystemExit(f"error: --mesh auto: no layout of {world} ranks fits {budget / 2**30:.2f} GiB per rank "
                         "(see the table): use more ranks, a smaller --global-batch or model, or --memory-per-device")
    keep, skip = [], {"--mesh": 1, "--schedule": 1, "--virtual-chunks": 1, "--micro-batches": 1,
                      "--activation-checkpointing": 0}
    items = iter(argv)
    for item in items:
        name = item.split("=")[0]
        if name in skip:
            if "=" not in item:
                for _ in range(skip[name]):
                    next(items, None)
            continue
        keep.append(item)
    return keep + auto_mesh.layout_flags(planned.best)
