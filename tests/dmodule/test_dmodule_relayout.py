"""A plan's redistributions as one collective each (``ndweave.dmodule.relayout``): every move of its table,
forward and backward with each layout a grad can arrive in, gives DTensor's own bits and placements without
DTensor's machinery; anything else is DTensor's ``redistribute`` itself. Its ``from_local`` / ``to_local``
give what torch's give, grads included."""

import contextlib

import pytest
import torch
import torch.distributed.tensor._redistribute as dtensor_redistribute
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ndweave.dmodule.relayout import from_local, redistribute, to_local
from ndweave.mesh.testing import STRICT_DTYPE, distributed

R, P, S1 = Replicate(), Partial(), Shard(1)

#: move name -> (from, to); each ran with every grad layout below
MOVES = {"all_gather": (S1, R), "reduce_scatter": (P, S1), "all_reduce": (P, R), "chunk": (R, S1),
         "features": (R, Shard(-1))}
GRADS = {"replicate": R, "partial": P, "shard": S1}


@contextlib.contextmanager
def _dtensor_moves():
    """Counts the moves DTensor's own redistribution machinery plans and runs (forward and backward)."""
    calls = []
    original = dtensor_redistribute.redistribute_local_tensor

    def counting(*args, **kwargs):
        calls.append(args[2].placements)
        return original(*args, **kwargs)

    dtensor_redistribute.redistribute_local_tensor = counting
    try:
        yield calls
    finally:
        dtensor_redistribute.redistribute_local_tensor = original


def _piece(shape, placement):
    """The shape of a rank's piece of a tensor of ``shape`` laid out ``placement`` on 2 ranks."""
    return tuple(n // 2 if placement.is_shard() and i == placement.dim % len(shape) else n for i, n in enumerate(shape))


def _moved(x_local, mesh, src, dst, grad_layout, grad_local, ours):
    """The moved DTensor's local tensor and placements, the input's grad and its placements, and how many
    moves DTensor's machinery made."""
    x = DTensor.from_local(x_local.clone().requires_grad_(), mesh, [src], run_check=False)
    x_grad = {}
    x.register_hook(lambda g: x_grad.update(value=g.to_local().clone(), placements=g.placements))
    with _dtensor_moves() as calls:
        y = redistribute(x, mesh, (dst,)) if ours else x.redistribute(mesh, (dst,))
        grad = DTensor.from_local(grad_local, mesh, [grad_layout], run_check=False, shape=y.shape, stride=y.stride())
        y.backward(grad)
    return y.to_local(), y.placements, x_grad["value"], x_grad["placements"], len(calls)


@pytest.mark.parity
@distributed(world_size=2, timeout=120)
def test_each_move_gives_dtensors_bits_and_layouts_without_its_machinery():
    torch.set_default_dtype(STRICT_DTYPE)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    rank = mesh.get_local_rank()
    for name, (src, dst) in MOVES.items():
        torch.manual_seed(0 if src == R else 1 + rank)  # (a replicated value is the same on every rank)
        x_local = torch.randn(3, 2 if src == S1 else 4, 4)
        for grad_name, grad_layout in GRADS.items():
            torch.manual_seed(10 if grad_layout == R else 11 + rank)
            grad_local = torch.randn(3, 2 if grad_layout == S1 else 4, 4)
            y, placements, gx, gx_placements, moves = _moved(x_local, mesh, src, dst, grad_layout, grad_local, True)
            ref_y, ref_placements, ref_gx, ref_gx_placements, ref_moves = _moved(x_local, mesh, src, dst, grad_layout,
                                                                                 grad_local, False)
            where = f"{name} ({src} -> {dst}), grad {grad_name}"
            assert torch.equal(y, ref_y) and placements == ref_placements, (where, placements, ref_placements)
            assert torch.equal(gx, ref_gx) and gx_placements == ref_gx_placements, (where, gx_placements,
                                                                                     ref_gx_placements)
            assert moves == 0 and ref_moves > 0, (where, moves, ref_moves)


@distributed(world_size=2, timeout=120)
def test_other_moves_are_dtensors_redistribute():
    """An uneven shard, a Partial other than a sum, and a move of no row of the table are DTensor's own
    redistribution, with its results."""
    torch.set_default_dtype(STRICT_DTYPE)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    torch.manual_seed(0)
    cases = [(torch.randn(3, 5, 4), R, S1, "uneven"),  # (5 positions over 2 ranks)
             (torch.randn(3, 4, 4), Partial("avg"), R, "average"),
             (torch.randn(3, 2, 4), S1, Shard(2), "shard to shard")]
    for local, src, dst, what in cases:
        x = DTensor.from_local(local, mesh, [src], run_check=False)
        with _dtensor_moves() as calls:
            y = redistribute(x, mesh, (dst,))
        ref = x.redistribute(mesh, (dst,))
        assert len(calls) == 1, what
        assert y.placements == ref.placements and tuple(y.shape) == tuple(ref.shape), what
        assert torch.equal(y.to_local(), ref.to_local()), what


@pytest.mark.parity
@distributed(world_size=2, timeout=120)
def test_from_local_and_to_local_give_torchs_dtensors_and_grads():
    torch.set_default_dtype(STRICT_DTYPE)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    rank = mesh.get_local_rank()
    for placement in (S1, Shard(-1), R, P):
        torch.manual_seed(1 + rank)
        local = torch.randn(3, 2, 4)
        for grad_name, grad_layout in GRADS.items():
            results = []
            for ours in (True, False):
                x = local.clone().requires_grad_()
                d = from_local(x, mesh, (placement,)) if ours else DTensor.from_local(x, mesh, [placement],
                                                                                     run_check=False)
                torch.manual_seed(20 + rank)
                grad_local = torch.randn(_piece(d.shape, grad_layout))
                grad = DTensor.from_local(grad_local, mesh, [grad_layout], run_check=False, shape=d.shape,
                                          stride=d.stride())
                d.backward(grad)
                results.append((d.placements, tuple(d.shape), d.stride(), x.grad))
            (placements, shape, stride, gx), ref = results
            where = f"from_local {placement}, grad {grad_name}"
            assert (placements, shape, stride) == ref[:3], (where, placements, shape, stride, ref[:3])
            assert torch.equal(gx, ref[3]), where
    for placement, grad_placements in ((S1, None), (P, None), (Shard(-1), (Shard(2),)), (S1, (R,))):
        torch.manual_seed(1 + rank)
        whole = torch.randn(3, 2, 4) if placement.is_shard() else torch.randn(3, 4, 4)
        results = []
        for ours in (True, False):
            d = DTensor.from_local(whole.clone(), mesh, [placement], run_check=False).requires_grad_()
            piece = to_local(d, grad_placements) if ours else d.to_local(grad_placements=grad_placements)
            (piece * piece).sum().backward()
            results.append((d.grad.placements, tuple(d.grad.shape), d.grad.to_local()))
        where = f"to_local {placement}, grad_placements {grad_placements}"
        assert results[0][:2] == results[1][:2], (where, results[0][:2], results[1][:2])
        assert torch.equal(results[0][2], results[1][2]), where

