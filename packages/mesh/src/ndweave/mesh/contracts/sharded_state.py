"""The contract between whatever holds sharded state (a sharded optimizer, a DTensor model) and
checkpointing: where each rank's piece of a tensor lies in the global tensor, for every layout.

Every local tensor a DTensor layout leaves on a rank (``Shard`` on any tensor dim, uneven shards,
``_StridedShard``, several mesh dims, ``Replicate``) is a Cartesian product: along each tensor dim
the rank holds a set of global indices, whatever the indices along the other dims. Each set is a few
*runs* of consecutive indices: one for ``Shard``, ``split_factor`` of them for a fused [q | k | v]
weight laid out ``StridedShard(dim, split_factor=3)`` (rank r holds [q_r | k_r | v_r]).
:class:`ShardLayout` is those runs, computed with torch's own chunking from the global shape, mesh
shape, placements and a mesh coordinate: no process group, so one process can describe every rank.

A sharded optimizer (Megatron's layout) keeps a flat range ``[start, end)`` of the flattened local
tensor, cutting rows anywhere. :class:`StatePiece` is such a range of a layout, with its values. A
piece is a few boxes of the global tensor (:meth:`StatePiece.boxes`, and :meth:`StatePiece.chunks`
as DCP's chunk metadata), and pieces of any ranks of any layouts merge and reshard::

    layout = ShardLayout.from_placements((48, 16), (2,), [StridedShard(0, split_factor=3)], (1,))
    piece = slice_piece(full, layout, 0, 100, fqn="w")   # elements 0..99 of rank 1's local tensor
    full = merge_pieces(pieces)                          # every element covered, replicas agree
    mine = reshard_pieces(pieces, my_layout, start, end) # another layout's piece, no full tensor built
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ndweave.mesh.torch_compat import is_shard_like, split_indices

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

__all__ = ["Box", "ShardLayout", "StatePiece", "merge_pieces", "reshard_pieces", "slice_piece"]

#: ``(first global index, length)``: consecutive global indices along one tensor dim.
Run = tuple[int, int]
#: ``(global offsets, sizes, values)``: a block of the global tensor; values has shape ``sizes``.
Box = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's local tensor lies in the global tensor: along each tensor dim, the global
    indices it holds (in local order), as runs of consecutive indices.

    Example: a (6, 4) fused weight laid out ``StridedShard(0, split_factor=3)`` over 2 ranks; rank 1
    holds rows 1, 3 and 5::

        >>> ShardLayout.from_placements((6, 4), (2,), [StridedShard(0, split_factor=3)], (1,)).runs
        (((1, 1), (3, 1), (5, 1)), ((0, 4),))
    """

    global_shape: tuple[int, ...]
    """Shape of the unsharded tensor."""
    runs: tuple[tuple[Run, ...], ...]
    """Per tensor dim, the runs ``(first, length)`` of global indices the local tensor holds, in order."""
    replica: bool = False
    """The local tensor duplicates one another rank holds (a non-zero coordinate on a ``Replicate``
    mesh dim): a checkpoint writes each element once, from the rank whose pieces are not replicas."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(n) for n in self.global_shape))
        runs = tuple(tuple((int(a), int(n)) for a, n in dim_runs if n) for dim_runs in self.runs)
        object.__setattr__(self, "runs", runs)
        self.check()

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(sum(n for _, n in dim_runs) for dim_runs in self.runs)

    @property
    def numel(self) -> int:
        """Elements of the local tensor."""
        return math.prod(self.local_shape)

    def check(self, fqn: str = "") -> None:
        """``ValueError`` unless every run lies within the global shape and no dim repeats an index."""
        where = f"{fqn!r}: " if fqn else ""
        if len(self.runs) != len(self.global_shape):
            raise ValueError(f"{where}a layout of global shape {self.global_shape} needs runs for "
                             f"{len(self.global_shape)} tensor dims, got {len(self.runs)}")
        for dim, (size, dim_runs) in enumerate(zip(self.global_shape, self.runs)):
            for first, length in dim_runs:
                if first < 0 or length < 0 or first + length > size:
                    raise ValueError(f"{where}run ({first}, {length}) of tensor dim {dim} lies outside the "
                                     f"global shape {self.global_shape}")
            ordered = sorted(dim_runs)
            if any(a + n > b for (a, n), (b, _) in zip(ordered, ordered[1:])):
                raise ValueError(f"{where}the runs of tensor dim {dim} overlap: {dim_runs}")

    @classmethod
    def whole(cls, global_shape: Sequence[int]) -> ShardLayout:
        """The layout of an unsharded tensor (one rank holds all of it)."""
        return cls(tuple(global_shape), tuple(((0, n),) for n in global_shape))

    @classmethod
    def from_placements(cls, global_shape: Sequence[int], mesh_shape: Sequence[int],
                        placements: Sequence[Placement], coordinate: Sequence[int]) -> ShardLayout:
        """The layout of the rank at ``coordinate`` of a mesh of ``mesh_shape``, for a tensor of
        ``global_shape`` laid out with ``placements`` (one per mesh dim): mesh dims left to right,
        each ``Shard``/``StridedShard`` splitting its tensor dim with torch's chunking, exactly as
        ``distribute_tensor`` does. Needs no process group."""
        if not len(mesh_shape) == len(placements) == len(coordinate):
            raise ValueError(f"mesh shape {tuple(mesh_shape)}, placements {list(placements)} and coordinate "
                             f"{tuple(coordinate)} must have one entry per mesh dim")
        ndim = len(global_shape)
        indices = [torch.arange(n) for n in global_shape]
        replica = False
        for mesh_dim, (size, placement, index) in enumerate(zip(mesh_shape, placements, coordinate)):
            if not 0 <= index < size:
                raise ValueError(f"coordinate {tuple(coordinate)} lies outside the mesh shape {tuple(mesh_shape)}")
            if is_shard_like(placement):
                if not -ndim <= placement.dim < ndim:
                    raise ValueError(f"{placement} on mesh dim {mesh_dim} names no dim of shape {tuple(global_shape)}")
                dim = placement.dim % ndim
                indices[dim] = split_indices(placement, indices[dim], size)[index]
            elif placement.is_replicate():
                replica = replica or index != 0
            else:
                raise ValueError(f"mesh dim {mesh_dim} is {placement}: a Partial tensor's local values are not "
                                 "pieces of its global value; reduce it (redistribute to Replicate) first")
        return cls(tuple(global_shape), tuple(_runs(ix) for ix in indices), replica)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> ShardLayout:
        """The layout of this rank's local tensor of ``tensor`` (a DTensor, e.g. a tensor-parallel
        parameter); a plain tensor is whole."""
        if not isinstance(tensor, DTensor):
            return cls.whole(tensor.shape)
        mesh = tensor.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"this rank is not in {mesh}: it holds no piece of the DTensor")
        return cls.from_placements(tensor.shape, mesh.shape, tensor.placements, coordinate)


def _runs(indices: torch.Tensor) -> tuple[Run, ...]:
    if not indices.numel():
        return ()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(indices.diff() != 1).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([indices.numel()])])
    return tuple((int(indices[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist()))


class _Block(NamedTuple):
    """One box of a flat range: ``offsets``/``sizes`` in the global tensor; its values are elements
    ``[lo, hi)`` of the range viewed as ``local_sizes``, narrowed by ``within`` (a start per dim)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    lo: int
    hi: int
    local_sizes: tuple[int, ...]
    within: tuple[int, ...]

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        values = flat[self.lo : self.hi].reshape(self.local_sizes)
        for dim, (first, size) in enumerate(zip(self.within, self.sizes)):
            values = values.narrow(dim, first, size)
        return values


def _local_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Flat ``[start, end)`` of a row-major tensor of ``shape`` as ``(offsets, sizes, flat start)``
    boxes, each a contiguous part of the range: a partial first row, whole rows, a partial last row
    (the partial rows themselves split the same way along the next dim)."""
    if start >= end:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    rest = len(shape) - 1
    boxes = []
    row, col = divmod(start, inner)
    if col:
        stop = min(end, (row + 1) * inner) - row * inner
        boxes += [((row, *o), (1, *s), row * inner + f) for o, s, f in _local_boxes(shape[1:], col, stop)]
        start = (row + 1) * inner
    if start + inner <= end:
        rows = end // inner - start // inner
        boxes.append(((start // inner,) + (0,) * rest, (rows, *shape[1:]), start))
        start += rows * inner
    if start < end:
        row = start // inner
        boxes += [((row, *o), (1, *s), row * inner + f) for o, s, f in _local_boxes(shape[1:], 0, end - start)]
    return boxes


def _blocks(layout: ShardLayout, start: int, end: int) -> list[_Block]:
    """The boxes of the global tensor that ``[start, end)`` of ``layout``'s local tensor covers."""
    blocks = []
    for offsets, sizes, flat in _local_boxes(layout.local_shape, start, end):
        per_dim = []  # per tensor dim: (global first, first within the local box, length) of each run part
        for first, size, dim_runs in zip(offsets, sizes, layout.runs):
            parts, position = [], 0
            for global_first, length in dim_runs:
                lo, hi = max(first, position), min(first + size, position + length)
                if lo < hi:
                    parts.append((global_first + lo - position, lo - first, hi - lo))
                position += length
            per_dim.append(parts)
        for combo in itertools.product(*per_dim):
            blocks.append(_Block(tuple(c[0] for c in combo), tuple(c[2] for c in combo), flat - start,
                                 flat - start + math.prod(sizes), sizes, tuple(c[1] for c in combo)))
    return blocks


@dataclass(eq=False)
class StatePiece:
    """Elements ``[start, end)`` of one rank's flattened local tensor of a sharded tensor named ``fqn``.

    Checked on construction (and by every function here): ``data`` holds ``end - start`` values, the
    range lies within the local tensor, the layout within the global shape.
    """

    fqn: str
    """The tensor's fully qualified name (a parameter's FQN in the unwrapped model)."""
    data: torch.Tensor
    """The values of the range, flattened (any shape of ``end - start`` elements is taken flat)."""
    layout: ShardLayout
    """Where the local tensor lies in the global tensor."""
    start: int = 0
    """First element of the range within the flattened local tensor."""
    end: int | None = None
    """One past the last element (default: the whole local tensor)."""

    def __post_init__(self) -> None:
        if self.end is None:
            self.end = self.layout.numel if isinstance(self.layout, ShardLayout) else 0
        self.check()
        self.data = self.data.reshape(-1)

    def check(self) -> None:
        """``ValueError`` naming the fqn unless the piece is consistent."""
        if not isinstance(self.layout, ShardLayout) or not isinstance(self.data, torch.Tensor):
            raise ValueError(f"{self.fqn!r}: a piece needs a ShardLayout and a tensor, got "
                             f"{type(self.layout).__name__} and {type(self.data).__name__}")
        self.layout.check(self.fqn)
        if not 0 <= self.start <= self.end <= self.layout.numel:
            raise ValueError(f"{self.fqn!r}: range [{self.start}, {self.end}) lies outside the local tensor of "
                             f"{self.layout.numel} elements (shape {self.layout.local_shape})")
        if self.data.numel() != self.end - self.start:
            raise ValueError(f"{self.fqn!r}: range [{self.start}, {self.end}) holds {self.end - self.start} "
                             f"elements, its data {self.data.numel()}")

    @property
    def is_replica(self) -> bool:
        """Another rank holds the same values (see :attr:`ShardLayout.replica`)."""
        return self.layout.replica

    @classmethod
    def whole(cls, fqn: str, tensor: torch.Tensor) -> StatePiece:
        """A full (global) tensor as the one piece of an unsharded layout."""
        return cls(fqn, tensor.reshape(-1), ShardLayout.whole(tensor.shape))

    def boxes(self) -> list[Box]:
        """The piece as boxes of the global tensor: ``(global offsets, sizes, values)``, values a view
        of ``data``. A range of a ``Shard`` layout is at most a few boxes per tensor dim (partial
        rows); a strided shard adds one per run."""
        return [(b.offsets, b.sizes, b.view(self.data)) for b in _blocks(self.layout, self.start, self.end)]

    def chunks(self) -> list[ChunkStorageMetadata]:
        """The boxes as DCP's chunk metadata. A checkpoint stores every rank's non-replica pieces of a
        key as chunks of one global tensor (DCP keeps one writer per key for a plain tensor, so
        per-rank tensors under one key would overwrite each other)."""
        # imported here: torch.distributed.checkpoint costs a third of a second to import
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self.boxes()]


def reshard_pieces(pieces: Iterable[StatePiece], layout: ShardLayout, start: int = 0,
                   end: int | None = None) -> StatePiece:
    """The piece ``[start, end)`` of ``layout`` from pieces of any ranks of any layouts, without
    building the global tensor. Every element must be covered; where pieces overlap (replicas) they
    must agree. ``ValueError`` otherwise, naming the fqn."""
    pieces = list(pieces)
    if not pieces:
        raise ValueError("reshard_pieces needs at least one piece")
    first = pieces[0]
    for p in pieces:
        p.check()
        if (p.fqn, p.layout.global_shape, p.data.dtype) != (first.fqn, first.layout.global_shape, first.data.dtype):
            raise ValueError(f"pieces of {first.fqn!r} {first.layout.global_shape} {first.data.dtype} and "
                             f"{p.fqn!r} {p.layout.global_shape} {p.data.dtype} cannot merge")
    if layout.global_shape != first.layout.global_shape:
        raise ValueError(f"{first.fqn!r}: pieces of global shape {first.layout.global_shape} cannot fill a "
                         f"layout of global shape {layout.global_shape}")
    end = layout.numel if end is None else end
    out = StatePiece(first.fqn, first.data.new_empty(max(end - start, 0)), layout, start, end)
    covered = torch.zeros(out.data.numel(), dtype=torch.bool, device=out.data.device)
    targets = _blocks(layout, start, end)
    for piece in pieces:
        source = piece.data.reshape(-1)
        for src in _blocks(piece.layout, piece.start, piece.end):
            for dst in targets:
                _copy_overlap(src, source, dst, out.data, covered, first.fqn)
    missing = int((~covered).sum())
    if missing:
        raise ValueError(f"the pieces of {first.fqn!r} leave {missing} of {covered.numel()} elements uncovered")
    return out


def _copy_overlap(src: _Block, source: torch.Tensor, dst: _Block, target: torch.Tensor, covered: torch.Tensor,
                  fqn: str) -> None:
    lo = [max(a, b) for a, b in zip(src.offsets, dst.offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(src.offsets, src.sizes, dst.offsets, dst.sizes)]
    if any(a >= b for a, b in zip(lo, hi)):
        return
    values, into, seen = src.view(source), dst.view(target), dst.view(covered)
    for dim, (a, b) in enumerate(zip(lo, hi)):
        values = values.narrow(dim, a - src.offsets[dim], b - a)
        into = into.narrow(dim, a - dst.offsets[dim], b - a)
        seen = seen.narrow(dim, a - dst.offsets[dim], b - a)
    values = values.to(into.device)
    if seen.any():  # a replica: it must hold what the first copy held
        same = (into == values) | (into.isnan() & values.isnan())
        disagree = int((seen & ~same).sum())
        if disagree:
            raise ValueError(f"replicas of {fqn!r} disagree on {disagree} elements")
    into.copy_(values)
    seen.fill_(True)


def merge_pieces(pieces: Iterable[StatePiece]) -> torch.Tensor:
    """The global tensor from pieces of any ranks of any layouts that together cover it."""
    pieces = list(pieces)
    if not pieces:
        raise ValueError("merge_pieces needs at least one piece")
    shape = pieces[0].layout.global_shape if isinstance(pieces[0].layout, ShardLayout) else ()
    return reshard_pieces(pieces, ShardLayout.whole(shape)).data.view(shape)


def slice_piece(full: torch.Tensor, layout: ShardLayout, start: int = 0, end: int | None = None, *,
                fqn: str = "") -> StatePiece:
    """The piece ``[start, end)`` of ``layout`` cut from the global tensor ``full`` (a copy)."""
    if tuple(full.shape) != layout.global_shape:
        raise ValueError(f"{fqn!r}: a tensor of shape {tuple(full.shape)} is not the global tensor of a layout "
                         f"of global shape {layout.global_shape}")
    return reshard_pieces([StatePiece.whole(fqn, full)], layout, start, end)
