"""What ``DistributedDataParallel`` checks when it wraps a model, before any collective: its arguments,
the model (materialized, not wrapped twice) and what every DP rank must hold equal."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.mesh.agree import raise_on_every_rank
from ndweave.mesh.torch_compat import local_tensor

__all__ = ["DEFAULT_BUCKET_SIZE", "WRAPPED_MARK", "check_bucket_size", "check_materialized", "check_not_wrapped",
           "check_zero_stage", "fingerprint", "is_wrapped", "synced_params"]

#: Elements per bucket by default (32 MiB of fp32 grads): big enough for bandwidth, small enough that
#: the first buckets' reductions start early in backward and overlap the rest of it.
DEFAULT_BUCKET_SIZE = 2**23

# A module's wrapper (weakly), kept on the module so that wrapping it twice (two sets of hooks, two
# buffers) is an error: state on the module itself, not a process-wide registry. A deepcopy of the
# module keeps the mark but is not the wrapped module, so it may be wrapped.
WRAPPED_MARK = "_ndweave_data_parallel_wrapper"


def is_wrapped(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the module a live DDP wrapper holds."""
    ref = module.__dict__.get(WRAPPED_MARK)
    wrapper = ref() if ref is not None else None
    return wrapper is not None and wrapper.module is module


def check_zero_stage(group: dist.ProcessGroup | None, use_distributed_optimizer: bool | None,
                     zero_stage: int | None) -> int:
    """The ZeRO stage the two arguments ask for, or the same ``ValueError`` on every DP rank."""
    stage = (1 if use_distributed_optimizer else 0) if zero_stage is None else zero_stage
    problems = []
    if isinstance(stage, bool) or stage not in (0, 1, 2):
        more = (" zero_stage=3 shards the parameters too, which is FSDP: use torch's fully_shard (FSDP2) on the "
                "DP dim instead of DDP." if stage == 3 else "")
        problems.append(f"zero_stage={zero_stage!r} is not 0, 1 or 2.{more}")
    elif use_distributed_optimizer is not None and use_distributed_optimizer != (stage >= 1):
        problems.append(f"use_distributed_optimizer={use_distributed_optimizer} contradicts zero_stage={zero_stage} "
                        "(stages 1 and 2 reduce-scatter for a sharded optimizer, stage 0 all-reduces).")
    fix = ("DDP takes zero_stage=0 (all-reduce), 1 (= use_distributed_optimizer=True: optimizer state sharded) or "
           "2 (grads sharded too); pass one of zero_stage= and use_distributed_optimizer=, or both agreeing")
    if group is None:
        if problems:
            raise ValueError(f"DDP: {problems[0]} {fix}")
    else:
        raise_on_every_rank(group, "DDP(zero_stage=, use_distributed_optimizer=)", problems, ValueError, fix)
    return stage


def check_bucket_size(bucket_size: Any) -> None:
    # checked up front: 0 or a negative size used to mean "a bucket per param", a string failed deep inside
    if bucket_size is None or (isinstance(bucket_size, int) and not isinstance(bucket_size, bool) and bucket_size > 0):
        return
    raise ValueError(
        f"bucket_size must be a positive int number of elements per bucket (default {DEFAULT_BUCKET_SIZE}), or None "
        f"for one bucket per dtype; got {bucket_size!r}. It counts elements, not bytes: 32 MB of fp32 grads is "
        "bucket_size=8_000_000"
    )


def check_materialized(module: torch.nn.Module) -> None:
    # meta params have no storage: DDP would broadcast and bucket nothing, then fail in backward
    meta = [name for name, p in module.named_parameters() if local_tensor(p).is_meta]
    if meta:
        more = f" and {len(meta) - 4} more" if len(meta) > 4 else ""
        raise ValueError(
            f"parameters {meta[:4]}{more} are on the meta device (no data): materialize the model before "
            "wrapping it in DDP, e.g. module.to_empty(device=...) then initialize the weights "
            "(reset_parameters() or your init), or build it with ndweave.dmodule.deferred_init and parallelize_module"
        )


def check_not_wrapped(module: torch.nn.Module, wrapper_type: type) -> None:
    """Refuse a module already data-parallel (``wrapper_type``, torch's DDP), or holding such a part."""
    if isinstance(module, (wrapper_type, torch.nn.parallel.DistributedDataParallel)):
        raise ValueError(
            f"the module is already a {type(module).__name__}; wrap the underlying model once: "
            "DDP(model, mesh), not DDP(DDP(model, mesh))"
        )
    if is_wrapped(module):
        raise ValueError(
            "this module is already wrapped by an ndweave DistributedDataParallel (its hooks and grad buffers "
            "are in place); keep using that wrapper instead of wrapping the module again"
        )
    inner = [name for name, m in module.named_modules()
             if m is not module and (is_wrapped(m) or isinstance(m, wrapper_type))]
    if inner:
        raise ValueError(
            f"submodule {inner[0]!r} is already data-parallel; wrap either the whole model or its parts, not both"
        )


def fingerprint(module: torch.nn.Module, synced_ids: set[int], **arguments: Any) -> dict[str, str]:
    """What every DP rank must hold equal: its params and buffers (in order), and the arguments that
    decide the buckets and the collectives."""
    out = {f"argument {k}": repr(v) for k, v in arguments.items()}
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            layout = f", placements {tuple(t.placements)}" if isinstance(t, DTensor) else ""
            synced = (", synced" if id(t) in synced_ids else ", not synced") if kind == "parameter" else ""
            out[f"{kind} {name!r}"] = f"shape {list(t.shape)}, {t.dtype}{layout}{synced}"
    return out


def synced_params(named, params_to_ignore) -> list[tuple[str, torch.nn.Parameter]]:
    ignore_names = {x for x in params_to_ignore if isinstance(x, str)}
    ignore_ids = {id(x) for x in params_to_ignore if not isinstance(x, str)}
    unknown = ignore_names - {n for n, _ in named}
    if unknown:
        raise ValueError(f"params_to_ignore names {sorted(unknown)}, which the module does not have")
    return [(n, p) for n, p in named if p.requires_grad and n not in ignore_names and id(p) not in ignore_ids]
