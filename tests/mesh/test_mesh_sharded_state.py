"""Sharded state for every layout: pieces of any (source layout) merge into the global tensor and
reshard into any (destination layout), exactly; their boxes tile the global tensor once; bad pieces
are refused by name.

A layout here is what a Megatron-style run leaves on its ranks: a DTensor layout over a TP mesh (one
or more mesh dims of ``Shard``, ``StridedShard``, ``Replicate``), then, per local tensor, the flat
ranges a data-parallel sharded optimizer keeps (a bucket cut anywhere, through rows). Every rank of
every layout is simulated in one process.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from ndweave.mesh import init_device_mesh
from ndweave.mesh.contracts import ShardLayout, StatePiece, merge_pieces, reshard_pieces, shard_range, slice_piece
from ndweave.mesh.testing import distributed
from ndweave.mesh.torch_compat import StridedShard, local_tensor, split_tensor


@dataclass(frozen=True)
class Layout:
    """A TP layout (``placements`` over a mesh of ``mesh_shape``) with ``dp`` flat ranges per local tensor."""

    mesh_shape: tuple[int, ...] = ()
    placements: tuple = ()
    dp: int = 1

    def ranks(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], ShardLayout, int, int]]:
        """``(mesh coordinate, layout, start, end)`` of every rank's piece."""
        out = []
        for coordinate in itertools.product(*(range(n) for n in self.mesh_shape)):
            layout = ShardLayout.from_placements(shape, self.mesh_shape, self.placements, coordinate)
            # the local tensor sits 3 elements into a padded bucket: DP ranges cut it anywhere
            offset, numel = 3, layout.numel
            bucket = -(-(offset + numel + 2) // self.dp) * self.dp
            for dp_rank in range(self.dp):
                lo, hi = shard_range(bucket, self.dp, dp_rank)
                start, end = max(lo, offset) - offset, min(hi, offset + numel) - offset
                if start < end:
                    out.append((coordinate, layout, start, end))
        return out


def _local(full: torch.Tensor, layout: Layout, coordinate: tuple[int, ...]) -> torch.Tensor:
    """The local tensor as ``distribute_tensor`` cuts it: torch's chunking on the data itself, mesh dims
    left to right (an oracle independent of ShardLayout's index runs)."""
    local = full
    for n, placement, index in zip(layout.mesh_shape, layout.placements, coordinate):
        if not isinstance(placement, Replicate):
            local = split_tensor(placement, local, n)[index]
    return local


S, SS, R = Shard, StridedShard, Replicate()
# per global shape, the layouts whose pieces must convert into each other
GROUPS: dict[str, tuple[tuple[int, ...], dict[str, Layout]]] = {
    "matrix": ((12, 18), {
        "one process": Layout(),
        "DP2": Layout(dp=2),
        "DP4": Layout(dp=4),
        "TP2 Shard(0)": Layout((2,), (S(0),)),
        "TP2 Shard(1)": Layout((2,), (S(1),)),
        "TP2 Strided(0,3)": Layout((2,), (SS(0, split_factor=3),)),
        "TP2 Strided(1,3)": Layout((2,), (SS(1, split_factor=3),)),
        "DP2 x TP2 Shard(0)": Layout((2,), (S(0),), dp=2),
        "DP3 x TP2 Strided(1,3)": Layout((2,), (SS(1, split_factor=3),), dp=3),
        "TP2x2 Shard(0),Shard(1)": Layout((2, 2), (S(0), S(1))),
        "TP2x2 Shard(1),Strided(0,3)": Layout((2, 2), (S(1), SS(0, split_factor=3))),
        "FSDP+TP Strided(0,2),Shard(0)": Layout((2, 2), (SS(0, split_factor=2), S(0)), dp=2),
        "TP2 Replicate": Layout((2,), (R,)),
        "DP2 x TP2x2 Replicate,Shard(1)": Layout((2, 2), (R, S(1)), dp=2),
        "TP2x2x2 Shard(0),Replicate,Strided(1,3)": Layout((2, 2, 2), (S(0), R, SS(1, split_factor=3))),
    }),
    "uneven 129 rows": ((129, 8), {
        "one process": Layout(),
        "DP4": Layout(dp=4),
        "TP2 Shard(0)": Layout((2,), (S(0),)),
        "TP4 Shard(0)": Layout((4,), (S(0),)),
        "DP2 x TP2 Shard(0)": Layout((2,), (S(0),), dp=2),
        "TP2 Shard(1)": Layout((2,), (S(1),), dp=3),
        "TP2x2 Shard(0),Shard(0)": Layout((2, 2), (S(0), S(0))),
        "TP2x2 Replicate,Shard(0)": Layout((2, 2), (R, S(0))),
    }),
    "vocab 67 rows": ((67, 6), {
        "one process": Layout(),
        "TP4 Shard(0)": Layout((4,), (S(0),)),
        "TP8 Shard(0)": Layout((8,), (S(0),), dp=2),
        "DP3 x TP4 Shard(0)": Layout((4,), (S(0),), dp=3),
    }),
    "fused qkv bias": ((48,), {
        "one process": Layout(),
        "DP2": Layout(dp=2),
        "TP2 Shard(0)": Layout((2,), (S(0),)),
        "TP2 Strided(0,3)": Layout((2,), (SS(0, split_factor=3),)),
        "DP2 x TP2 Strided(0,3)": Layout((2,), (SS(0, split_factor=3),), dp=2),
        "TP4 Strided(0,3)": Layout((4,), (SS(0, split_factor=3),), dp=3),
        "TP2 Replicate": Layout((2,), (R,), dp=2),
    }),
    "3-d": ((4, 6, 5), {
        "one process": Layout(),
        "DP3": Layout(dp=3),
        "TP2 Shard(2)": Layout((2,), (S(2),), dp=2),
        "TP2x2 Shard(1),Shard(2)": Layout((2, 2), (S(1), S(2))),
        "TP2 Strided(1,3)": Layout((2,), (SS(1, split_factor=3),), dp=2),
    }),
    "0-d": ((), {
        "one process": Layout(),
        "DP2": Layout(dp=2),
        "TP2 Replicate": Layout((2,), (R,)),
    }),
}

PAIRS = [pytest.param(group, src, dst, id=f"{group}: {src} -> {dst}")
         for group, (_, layouts) in GROUPS.items() for src in layouts for dst in layouts]
EACH = [pytest.param(group, name, id=f"{group}: {name}") for group, (_, layouts) in GROUPS.items() for name in layouts]


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    """Distinct values, so a misplaced element cannot go unnoticed."""
    return torch.randperm(max(1, torch.Size(shape).numel()), generator=torch.Generator().manual_seed(0)).double().reshape(shape)


def _pieces(full: torch.Tensor, layout: Layout) -> list[StatePiece]:
    return [slice_piece(full, shard, start, end, fqn="w") for _, shard, start, end in layout.ranks(tuple(full.shape))]


@pytest.mark.parametrize("group,src,dst", PAIRS)
def test_pieces_reshard_between_layouts(group, src, dst):
    shape, layouts = GROUPS[group]
    full = _full(shape)
    pieces = _pieces(full, layouts[src])
    assert torch.equal(merge_pieces(pieces), full)
    resharded = [reshard_pieces(pieces, shard, start, end) for _, shard, start, end in layouts[dst].ranks(shape)]
    for piece, expected in zip(resharded, _pieces(full, layouts[dst])):
        assert torch.equal(piece.data, expected.data)
    assert torch.equal(merge_pieces(resharded), full)


@pytest.mark.parametrize("group,name", EACH)
def test_pieces_hold_what_distribute_tensor_keeps_and_their_boxes_tile_once(group, name):
    shape, layouts = GROUPS[group]
    layout, full = layouts[name], _full(shape)
    num_replicas = 1
    for n, placement in zip(layout.mesh_shape, layout.placements):
        num_replicas *= n if placement == R else 1
    owners = torch.zeros(shape, dtype=torch.long)
    copies = torch.zeros(shape, dtype=torch.long)
    for coordinate, shard, start, end in layout.ranks(shape):
        piece = slice_piece(full, shard, start, end, fqn="w")
        local = _local(full, layout, coordinate)
        assert shard.local_shape == tuple(local.shape)
        assert torch.equal(piece.data, local.reshape(-1)[start:end])
        assert piece.is_replica == any(p == R and i for p, i in zip(layout.placements, coordinate))
        boxes, chunks = piece.boxes(), piece.chunks()
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [(o, s) for o, s, _ in boxes]
        for offsets, sizes, values in boxes:
            box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            assert tuple(values.shape) == sizes and torch.equal(values, full[box])
            copies[box] += 1
            if not piece.is_replica:
                owners[box] += 1
        assert sum(v.numel() for _, _, v in boxes) == end - start
    assert bool((owners == 1).all()), "the non-replica pieces must write each element exactly once"
    assert bool((copies == num_replicas).all())


def test_strided_fused_qkv_keeps_its_own_q_k_v_runs():
    layout = ShardLayout.from_placements((6, 4), (2,), [StridedShard(0, split_factor=3)], (1,))
    assert layout.runs == (((1, 1), (3, 1), (5, 1)), ((0, 4),)) and layout.local_shape == (3, 4)
    # a flat range through the middle row of the shard: a partial row, then one row per run
    piece = slice_piece(torch.arange(24.0).reshape(6, 4), layout, 2, 12)
    assert [(o, s) for o, s, _ in piece.boxes()] == [((1, 2), (1, 2)), ((3, 0), (1, 4)), ((5, 0), (1, 4))]


def test_replica_marker_follows_replicate_mesh_dims():
    layouts = {c: ShardLayout.from_placements((4, 4), (2, 2), [R, S(1)], c) for c in itertools.product(range(2), range(2))}
    assert {c for c, lay in layouts.items() if lay.replica} == {(1, 0), (1, 1)}
    assert layouts[(0, 1)].runs == layouts[(1, 1)].runs == (((0, 4),), ((2, 2),))


def test_invalid_pieces_are_refused_by_name():
    whole = ShardLayout.whole((4, 3))
    with pytest.raises(ValueError, match=r"'w': range \[0, 4\) holds 4 elements, its data 5"):
        StatePiece("w", torch.zeros(5), whole, 0, 4)
    with pytest.raises(ValueError, match=r"'w': range \[10, 13\) lies outside the local tensor of 12 elements"):
        StatePiece("w", torch.zeros(3), whole, 10, 13)
    with pytest.raises(ValueError, match=r"run \(2, 3\) of tensor dim 0 lies outside the global shape \(4,\)"):
        ShardLayout((4,), (((2, 3),),))
    with pytest.raises(ValueError, match="the runs of tensor dim 0 overlap"):
        ShardLayout((4,), (((0, 2), (1, 2)),))
    with pytest.raises(ValueError, match="needs runs for 2 tensor dims, got 1"):
        ShardLayout((4, 3), (((0, 4),),))
    with pytest.raises(ValueError, match="Partial tensor"):
        ShardLayout.from_placements((4,), (2,), [Partial()], (0,))
    with pytest.raises(ValueError, match=r"coordinate \(2,\) lies outside the mesh shape \(2,\)"):
        ShardLayout.from_placements((4,), (2,), [S(0)], (2,))
    with pytest.raises(ValueError, match=r"'w': a tensor of shape \(3, 4\) is not the global tensor"):
        slice_piece(torch.zeros(3, 4), whole, fqn="w")
    piece = StatePiece.whole("w", torch.zeros(4, 3))
    piece.end = 13  # corrupted after construction (e.g. a tampered file): caught when used
    with pytest.raises(ValueError, match="'w': range"):
        merge_pieces([piece])


def test_merge_refuses_gaps_mixed_tensors_and_disagreeing_replicas():
    full = torch.arange(48.0)  # hf_gpt2's c_attn bias layout on TP=2 x DP=2: four pieces of 12
    pieces = _pieces(full, GROUPS["fused qkv bias"][1]["DP2 x TP2 Strided(0,3)"])
    assert [p.data.numel() for p in pieces] == [12, 12, 12, 12]
    with pytest.raises(ValueError, match="the pieces of 'w' leave 12 of 48 elements uncovered"):
        merge_pieces(pieces[1:])
    with pytest.raises(ValueError, match=r"pieces of 'w' \(48,\) torch.float32 and 'b' \(48,\) torch.float32 cannot merge"):
        merge_pieces([pieces[0], StatePiece.whole("b", full)])
    with pytest.raises(ValueError, match="torch.float64 cannot merge"):
        merge_pieces([pieces[0], StatePiece.whole("w", full.double())])
    with pytest.raises(ValueError, match=r"pieces of global shape \(48,\) cannot fill a layout of global shape \(4, 12\)"):
        reshard_pieces(pieces, ShardLayout.whole((4, 12)))
    replica = ShardLayout.from_placements((48,), (2,), [R], (1,))
    assert torch.equal(merge_pieces([*pieces, slice_piece(full, replica, 5, 9, fqn="w")]), full)
    wrong = slice_piece(full, replica, 5, 9, fqn="w")
    wrong.data[1] += 1
    with pytest.raises(ValueError, match="replicas of 'w' disagree on 1 elements"):
        merge_pieces([*pieces, wrong])


# (mesh shape, placements, global shape): real DTensors agree with the simulated layouts
DTENSOR_LAYOUTS = [
    ((2, 2), (S(0), S(1)), (5, 6)),
    ((2, 2), (SS(0, split_factor=2), S(0)), (8, 4)),
    ((2, 2), (R, SS(1, split_factor=3)), (4, 12)),
    ((2, 2), (S(1), SS(0, split_factor=3)), (12, 6)),
    ((4,), (SS(1, split_factor=3),), (3, 24)),
    ((4,), (S(0),), (129, 2)),
]


@distributed(world_size=4)
def test_layout_of_a_dtensor_is_its_local_tensor():
    meshes = {mesh_shape: init_device_mesh("cpu", mesh_shape).device_mesh for mesh_shape, _, _ in DTENSOR_LAYOUTS}
    for mesh_shape, placements, shape in DTENSOR_LAYOUTS:
        mesh = meshes[mesh_shape]
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        dt = distribute_tensor(full, mesh, list(placements))
        layout = ShardLayout.of(dt)
        assert layout == ShardLayout.from_placements(shape, mesh_shape, placements, mesh.get_coordinate())
        assert torch.equal(slice_piece(full, layout).data, local_tensor(dt).reshape(-1)), (placements, layout)
    assert ShardLayout.of(full) == ShardLayout.whole(full.shape)
