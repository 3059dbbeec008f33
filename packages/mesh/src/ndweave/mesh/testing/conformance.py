"""``check_data_parallel``: does a data-parallel wrapper meet the contract? Checked with numbers.

Call it inside a distributed test body with a function that wraps a model::

    @distributed(world_size=4)
    def test_my_wrapper_meets_the_contract():
        check_data_parallel(lambda module, dp_mesh: MyDDP(module, dp_mesh), tensor_parallel_size=2)

It builds small float64 models on every rank, wraps them, trains micro-batches of a global batch
split over the data-parallel ranks, and compares what the wrapper holds after ``finish_grad_sync()``
with the gradient one process computes on the whole batch (:data:`~ndweave.mesh.testing.STRICT`
tolerance): accumulation with ``no_sync()``, with ``set_is_last_microbatch()`` and with one
micro-batch; the mean or the sum over DP as ``grad_reduction`` declares; the bucket layout (every
trainable param in one bucket, zero padding, one layout on every rank); with ``param_data``, that its
views are the params' local tensors and that each DP rank's ``shard_range`` holds the reduced grads;
``finish_grad_sync()`` twice changes nothing; ``zero_grad_buffer()`` zeroes. With
``tensor_parallel_size > 1`` the same runs on a (DP, TP) mesh with column/row-parallel DTensor params,
unevenly sharded. With ``expert_parallel_size > 1`` it runs on a (DP, EP) mesh whose two dims both
split the batch, with one weight's rows sharded over EP the way experts are (each EP rank holds some
rows, and every EP rank's part of the batch meets all of them), so that weight's grad is reduced over
DP only and every other over DP x EP.

Everything about reduction is read per bucket: each bucket names the group it is reduced over
(``GradBucket.data_parallel_group``), which must hold this rank and only ranks of the data-parallel
mesh; its numel divides by that group's size and its ``shard_range`` is this rank's range in that
group. A wrapper may reduce different params over different groups (expert parallelism reduces
experts over fewer ranks than dense params). Its ``grad_data`` may be the whole bucket or only this
rank's range of it (a gradient shard, as ZeRO-2 keeps), when ``param_data`` holds the whole bucket.
A bucket marked ``reduced_whole`` is checked whole, and must hold the same bits on every rank of its group.

Every rank reaches every collective; problems are gathered and raised as one ``AssertionError`` on
all ranks together, naming the rank, the model, the run and the tensor.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ndweave.mesh.contracts import DataParallelWrapper, GradBucket, uses_distributed_optimizer
from ndweave.mesh.testing.parity import STRICT, STRICT_DTYPE, assert_close
from ndweave.mesh.torch_compat import local_shape_and_offset, local_tensor

__all__ = ["check_data_parallel"]

MakeWrapper = Callable[[torch.nn.Module, DeviceMesh], DataParallelWrapper]

_IN, _HIDDEN, _OUT = 5, 7, 3  # 7 hidden units over TP=2: uneven shards (4 and 3 rows)
_ROWS = 2  # rows per micro-batch
_MAX_LINES = 24  # problems reported (of every rank's), enough to see the pattern


def check_data_parallel(make_wrapper: MakeWrapper, *, device_type: str = "cpu", tensor_parallel_size: int = 1,
                        expert_parallel_size: int = 1, num_micro_batches: int = 3) -> None:
    """Assert that ``make_wrapper(module, data_parallel_mesh)`` returns a wrapper meeting
    :class:`~ndweave.mesh.contracts.DataParallelWrapper` (see the module docstring for what is checked).

    Call on every rank of the default process group. ``make_wrapper`` gets a float64 model on
    ``device_type`` and the 1-D ``"DP"`` mesh (in the expert-parallel case the 2-D ``("DP", "EP")``
    mesh), and returns the wrapped model (called as ``wrapper(x)``). The data-parallel size is the
    world size divided by ``tensor_parallel_size``.
    """
    world = dist.get_world_size()
    for name, size in (("tensor_parallel_size", tensor_parallel_size), ("expert_parallel_size", expert_parallel_size)):
        if world % size:
            raise ValueError(f"{name}={size} does not divide the world size {world}")
    device = torch.device(device_type)
    dp_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("DP",))
    _check(make_wrapper, _Case("plain params", _mlp(device), None, dp_mesh), num_micro_batches)
    if tensor_parallel_size > 1:
        mesh = init_device_mesh(device_type, (world // tensor_parallel_size, tensor_parallel_size),
                                mesh_dim_names=("DP", "TP"))
        model = _mlp(device)
        reference = copy.deepcopy(model)
        # the column-parallel output stays a DTensor: only it knows the uneven shards' global shape
        parallelize_module(model, mesh["TP"], {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()})
        _check(make_wrapper, _Case("DTensor (TP) params", model, reference, mesh["DP"]), num_micro_batches)
    if expert_parallel_size > 1:
        mesh = init_device_mesh(device_type, (world // expert_parallel_size, expert_parallel_size),
                                mesh_dim_names=("DP", "EP"))
        model = _mlp(device)
        reference = copy.deepcopy(model)
        model[2] = _RowsOverEP(model[2], mesh["EP"])
        _check(make_wrapper, _Case("params sharded over EP", model, reference, mesh), num_micro_batches)


@dataclass
class _Case:
    name: str
    model: torch.nn.Module
    reference: torch.nn.Module | None
    """An unparallelized copy (``None``: copy ``model``, which is plain)."""
    dp_mesh: DeviceMesh
    """The dims that split the batch: ``"DP"``, or ``("DP", "EP")``."""


class _RowsOverEP(torch.nn.Module):
    """A Linear whose weight rows are sharded over EP (``Shard(0)``, 7 rows: uneven) like experts,
    while every EP rank's part of the batch meets all of them: the rows are all-gathered, and the
    gather's backward reduce-scatters their grads, so each EP rank's shard grad sums every EP rank's
    part of the batch, as an expert's grad does after the token all-to-all's backward."""

    def __init__(self, linear: torch.nn.Linear, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach().clone(), ep_mesh, [Shard(0)]))
        self.bias = torch.nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.weight.redistribute(self.weight.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        return F.linear(x, rows, self.bias)


def _mlp(device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same params on every rank, whatever the wrapper broadcasts
    return torch.nn.Sequential(
        torch.nn.Linear(_IN, _HIDDEN), torch.nn.Tanh(), torch.nn.Linear(_HIDDEN, _HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(_HIDDEN, _OUT),
    ).to(device=device, dtype=STRICT_DTYPE)


def _check(make_wrapper: MakeWrapper, case: _Case, k: int) -> None:
    reference = copy.deepcopy(case.model) if case.reference is None else case.reference
    names = {id(p): n for n, p in case.model.named_parameters()}
    wrapper = make_wrapper(case.model, case.dp_mesh)
    where = f"{type(wrapper).__name__} on {case.name}"
    _agree(where, _check_interface(wrapper))
    _agree(where, _check_layout(wrapper, case))
    dp_size, dp_rank = case.dp_mesh.size(), _rank_in(case.dp_mesh)
    runs = [("no_sync()", k, "no_sync"), ("set_is_last_microbatch()", k, "flag"), ("one micro-batch", 1, "no_sync")]
    for step, (run, num, mode) in enumerate(runs):
        x, y = _batch(step, dp_size * num, case.model[0].weight.device)
        expected = _reference_grads(reference, x, y)
        for i in range(num):
            last = i == num - 1
            if mode == "flag":
                wrapper.set_is_last_microbatch(last)
            with contextlib.nullcontext() if last or mode == "flag" else wrapper.no_sync():
                rows = slice((dp_rank * num + i) * _ROWS, (dp_rank * num + i + 1) * _ROWS)
                (F.mse_loss(wrapper(x[rows]), y[rows]) / num).backward()
        wrapper.finish_grad_sync()
        _agree(f"{where}, {run}", _check_reduced(wrapper, expected, names, dp_size))
        _agree(f"{where}, {run}", _check_whole_alike(wrapper))
        before = [b.grad_data.clone() for b in wrapper.grad_buckets()]
        wrapper.finish_grad_sync()
        changed = [i for i, (b, old) in enumerate(zip(wrapper.grad_buckets(), before)) if not torch.equal(b.grad_data, old)]
        _agree(f"{where}, {run}", [f"a second finish_grad_sync() changed bucket {i}" for i in changed])
        wrapper.zero_grad_buffer()
        dirty = [i for i, b in enumerate(wrapper.grad_buckets()) if b.grad_data.any()]
        _agree(f"{where}, {run}", [f"zero_grad_buffer() left bucket {i}'s grad_data non-zero" for i in dirty])


def _rank_in(mesh: DeviceMesh) -> int:
    """This rank's index in ``mesh`` counted row-major (its slice of the global batch)."""
    index = 0
    for size, coordinate in zip(mesh.shape, mesh.get_coordinate()):
        index = index * size + coordinate
    return index


def _batch(step: int, num_micro_batches: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(num_micro_batches * _ROWS, _IN, generator=g, dtype=STRICT_DTYPE)
    y = torch.randn(num_micro_batches * _ROWS, _OUT, generator=g, dtype=STRICT_DTYPE)
    return x.to(device), y.to(device)


def _reference_grads(reference: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mean-loss grad of the whole global batch, on one process."""
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(F.mse_loss(reference(x), y), [p for _, p in named])
    return {n: g.detach() for (n, _), g in zip(named, grads)}


def _check_interface(wrapper) -> list[str]:
    if not isinstance(wrapper, DataParallelWrapper):
        missing = [m for m in ("grad_reduction", "grad_buckets", "no_sync", "set_is_last_microbatch",
                               "finish_grad_sync", "zero_grad_buffer") if not hasattr(wrapper, m)]
        return [f"is not a DataParallelWrapper: it lacks {missing}"]
    if wrapper.grad_reduction not in ("mean", "sum"):
        return [f"grad_reduction is {wrapper.grad_reduction!r}, not 'mean' or 'sum'"]
    return []


def _check_layout(wrapper: DataParallelWrapper, case: _Case) -> list[str]:
    problems = []
    names = {id(p): n for n, p in case.model.named_parameters()}
    try:
        sharded = uses_distributed_optimizer(wrapper)
    except ValueError as err:
        return [str(err)]
    seen: dict[int, str] = {}
    mesh_ranks = set(case.dp_mesh.mesh.flatten().tolist())
    for index, bucket in enumerate(wrapper.grad_buckets()):
        problems += _check_group(index, bucket, mesh_ranks)
        numel, size = bucket.numel, bucket.data_parallel_size
        if bucket.grad_data.dim() != 1 or numel % size:
            problems.append(f"bucket {index}: grad_data of shape {tuple(bucket.grad_data.shape)} is not 1-D with a "
                            f"numel divisible by the DP size {size} of the group it is reduced over")
        elif sharded and bucket.grad_data.numel() not in (numel, numel // size):
            problems.append(f"bucket {index}: grad_data of {bucket.grad_data.numel()} elements is neither the whole "
                            f"bucket (param_data's {numel}) nor one rank's range of it ({numel // size})")
        end = 0
        for bp in sorted(bucket.params, key=lambda bp: bp.offset):
            local = local_tensor(bp.param)
            if id(bp.param) in seen:
                problems.append(f"{bp.name} is in two buckets (also as {seen[id(bp.param)]})")
            seen[id(bp.param)] = bp.name
            if bp.name != names.get(id(bp.param)):
                problems.append(f"bucket {index}: a param is named {bp.name!r}, in the unwrapped model "
                                f"{names.get(id(bp.param))!r} (BucketParam.name is the unwrapped FQN)")
            if bp.numel != local.numel() or bp.offset < end or bp.offset + bp.numel > numel:
                problems.append(f"bucket {index}: {bp.name} at [{bp.offset}, {bp.offset + bp.numel}) overlaps "
                                f"another param or the bucket's end, or is not its local numel {local.numel()}")
            end = bp.offset + bp.numel
            if sharded:
                view = bucket.param_data[bp.offset : bp.offset + bp.numel]
                if not (local.is_contiguous() and local.dtype == view.dtype and local.data_ptr() == view.data_ptr()):
                    problems.append(f"bucket {index}: the local tensor of {bp.name} is not the param_data view "
                                    f"at offset {bp.offset}")
    return problems + _check_coverage(wrapper, case, seen)


def _check_group(index: int, bucket: GradBucket, mesh_ranks: set[int]) -> list[str]:
    """The group a bucket is reduced over holds this rank and only ranks of the data-parallel mesh."""
    if bucket.data_parallel_group is None:
        return []
    ranks = dist.get_process_group_ranks(bucket.data_parallel_group)
    if dist.get_rank() not in ranks or not set(ranks) <= mesh_ranks:
        return [f"bucket {index}: reduced over ranks {ranks}, which is not a group of this rank within the "
                f"data-parallel mesh's ranks {sorted(mesh_ranks)}"]
    return []


def _check_coverage(wrapper: DataParallelWrapper, case: _Case, seen: dict[int, str]) -> list[str]:
    problems = []
    trainable = {id(p): n for n, p in case.model.named_parameters() if p.requires_grad}
    if any(id(bp.param) not in trainable for b in wrapper.grad_buckets() for bp in b.params):
        problems.append("a bucket holds a parameter that is not a trainable param of the wrapped model")
    missing = sorted(n for i, n in trainable.items() if i not in seen)
    if missing:
        problems.append(f"trainable params in no bucket: {missing}")
    layout = [(b.numel, [(bp.name, bp.offset) for bp in b.params]) for b in wrapper.grad_buckets()]
    layouts: list = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    if any(other != layout for other in layouts):
        problems.append("ranks lay their buckets out differently (numel, param offsets): "
                        f"{dict(enumerate(layouts))}")
    return problems


def _check_reduced(wrapper: DataParallelWrapper, expected: dict[str, torch.Tensor], names: dict[int, str],
                   dp_size: int) -> list[str]:
    """Compare what the wrapper holds after the sync with ``expected`` (mean over DP) times the
    declared reduction's factor; if it fails and the other factor fits, say so instead."""
    sharded = uses_distributed_optimizer(wrapper)
    expected = {id(bp.param): expected[names[id(bp.param)]] for b in wrapper.grad_buckets() for bp in b.params}
    # full_tensor of DTensor .grads is a collective: gather them all here, the same on every rank
    published = {} if sharded else {id(bp.param): _full(bp.param.grad) for b in wrapper.grad_buckets() for bp in b.params}
    declared = wrapper.grad_reduction
    factor = {"mean": 1.0, "sum": float(dp_size)}
    problems = _compare(wrapper, sharded, expected, published, factor[declared])
    if problems and dp_size > 1:
        other = "sum" if declared == "mean" else "mean"
        if not _compare(wrapper, sharded, expected, published, factor[other]):
            return [f"grad_reduction is {declared!r} but the synced grads are the {other} over the DP ranks"]
    return problems


def _check_whole_alike(wrapper: DataParallelWrapper) -> list[str]:
    """A bucket marked ``reduced_whole`` holds the same bits on every rank of its group (an optimizer
    takes its grad norm from it with no collective: any difference would split the ranks' steps)."""
    problems = []
    for index, bucket in enumerate(wrapper.grad_buckets()):
        if bucket.reduced_whole and bucket.data_parallel_group is not None:
            everyone = [torch.empty_like(bucket.grad_data) for _ in range(bucket.data_parallel_size)]
            dist.all_gather(everyone, bucket.grad_data, group=bucket.data_parallel_group)
            if not all(torch.equal(other, bucket.grad_data) for other in everyone):
                problems.append(f"bucket {index} is marked reduced_whole but its grad_data differs between DP ranks")
    return problems


def _compare(wrapper: DataParallelWrapper, sharded: bool, expected: dict[int, torch.Tensor],
             published: dict[int, torch.Tensor | None], factor: float) -> list[str]:
    """Problems of this rank's reduced grads (local work only: no collectives)."""
    problems = []
    for index, bucket in enumerate(wrapper.grad_buckets()):
        whole = bucket.reduced_whole  # (every range reduced: all of it is checked)
        lo, hi = bucket.shard_range() if sharded and not whole else (0, bucket.numel)
        reduced = bucket.grad_data if whole else bucket.reduced_grad()
        covered = torch.zeros(bucket.numel, dtype=torch.bool)
        for bp in bucket.params:
            full = expected[id(bp.param)] * factor
            want = _local_part(bp.param, full).reshape(-1)
            start, end = max(lo, bp.offset), min(hi, bp.offset + bp.numel)
            covered[bp.offset : bp.offset + bp.numel] = True
            if start < end:
                problems += _close(reduced[start - lo:end - lo], want[start - bp.offset : end - bp.offset],
                                   f"bucket {index} grad_data of {bp.name} [{start}, {end})")
            if not sharded:
                got = published[id(bp.param)]
                if got is None:
                    problems.append(f".grad of {bp.name} is None after finish_grad_sync()")
                else:
                    problems += _close(got, full, f".grad of {bp.name}")
        padding = reduced[~covered[lo:hi].to(reduced.device)]
        if padding.any():
            problems.append(f"bucket {index}: {int(padding.count_nonzero())} padding elements in [{lo}, {hi}) are not zero")
    return problems


def _full(grad: torch.Tensor | None) -> torch.Tensor | None:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _local_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` laid out like ``param``'s local tensor."""
    if not isinstance(param, DTensor):
        return full
    shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
    for dim, (start, size) in enumerate(zip(offset, shape)):
        full = full.narrow(dim, start, size)
    return full


def _close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> list[str]:
    try:
        assert_close(actual, expected, name=name, tol=STRICT)
    except AssertionError as err:
        return [str(err)]
    return []


def _agree(where: str, problems: list[str]) -> None:
    """Raise on every rank if any rank found a problem, so no rank is left waiting in a collective."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = [f"rank {rank}: {p}" for rank, mine in enumerate(everyone) for p in mine]
    if found:
        more = f"\n... and {len(found) - _MAX_LINES} more" if len(found) > _MAX_LINES else ""
        raise AssertionError(f"data-parallel contract broken by {where}:\n" + "\n".join(found[:_MAX_LINES]) + more)
