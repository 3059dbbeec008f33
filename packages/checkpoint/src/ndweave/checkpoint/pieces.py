"""Flat ranges of sharded tensors (``StatePiece``s) as DCP sees them: chunks of one global tensor.

A sharded optimizer's state on one rank is a flat range of a parameter's local tensor, cutting rows
anywhere; a fused q|k|v weight laid out ``StridedShard`` is several runs per tensor dim. Neither is
one box of the global tensor, which is all a DTensor's DCP support knows (DCP refuses a
``StridedShard`` DTensor outright). Both are a few boxes (``StatePiece.boxes()``), and DCP stores
any set of non-overlapping boxes of one global tensor as the chunks of one key.

:class:`PieceSet` is the state-dict leaf that carries them: it implements DCP's checkpointable
protocol (``__create_write_items__`` on save, ``__create_chunk_list__`` on load, the hooks DTensor
itself uses) so DCP's default planners plan it like a DTensor; :class:`PieceSavePlanner` and
:class:`PieceLoadPlanner` only add the lookup of a box by its offsets, which DCP does for tensors
alone. What lands on disk is an ordinary chunked tensor: plain ``dcp.load`` reads it.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ndweave.mesh.contracts import ShardLayout, StatePiece
from ndweave.mesh.torch_compat import StridedShard, local_tensor

from ndweave.checkpoint.buffers import StagingBuffers

__all__ = ["PieceLoadPlanner", "PieceSavePlanner", "PieceSet", "needs_pieces", "written_by_this_rank_alone"]


class PieceSet:
    """This rank's pieces of one global tensor, as the chunks DCP writes or reads.

    On save, give only the pieces this rank must write (no ``is_replica`` ones): every element of
    the global tensor must be in exactly one rank's pieces. On load, give every piece the rank needs,
    replicas included; DCP reads into the pieces' ``data`` in place.
    """

    def __init__(self, pieces: Sequence[StatePiece]) -> None:
        self.pieces = list(pieces)
        if not self.pieces:
            raise ValueError("a PieceSet needs at least one piece")
        first = self.pieces[0]
        for p in self.pieces:
            if (p.layout.global_shape, p.data.dtype) != (first.layout.global_shape, first.data.dtype):
                raise ValueError(f"pieces of {first.fqn!r} disagree: {first.layout.global_shape} {first.data.dtype} "
                                 f"and {p.layout.global_shape} {p.data.dtype}")
        self.global_shape = torch.Size(first.layout.global_shape)
        self.dtype = first.data.dtype
        self.boxes = [(torch.Size(o), torch.Size(s), v) for p in self.pieces for o, s, v in p.boxes() if v.numel()]
        self._by_offsets = {o: v for o, _, v in self.boxes}

    @classmethod
    def of_dtensor(cls, tensor: DTensor, *, with_replicas: bool) -> PieceSet | None:
        """The local tensor of ``tensor`` as a piece set (views of it); ``None`` when it is a replica
        that need not be written."""
        layout = ShardLayout.of(tensor)
        if layout.replica and not with_replicas:
            return None
        return cls([StatePiece("", local_tensor(tensor).detach().reshape(-1), layout)])

    def size(self) -> torch.Size:
        """The global shape (what DCP compares with the checkpoint's)."""
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.global_shape,
                ),
            )
            for offsets, sizes, _ in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in self.boxes]

    def box(self, index: MetadataIndex) -> torch.Tensor:
        """The values of the box ``index`` names: by position on load (DCP numbers this rank's chunk
        list), by offsets on save (the global plan renumbers chunks across ranks)."""
        if index.index is not None and index.index < len(self.boxes) and self.boxes[index.index][0] == index.offset:
            return self.boxes[index.index][2]
        try:
            return self._by_offsets[index.offset]
        except KeyError:
            raise ValueError(f"{index.fqn!r} holds no chunk at offsets {tuple(index.offset or ())} on this rank") from None


def needs_pieces(tensor: Any) -> bool:
    """Whether a DTensor's local tensor is more than one box of the global tensor (a
    ``StridedShard`` placement): DCP cannot describe it, a :class:`PieceSet` can. Every other
    placement leaves one box, which DCP saves natively."""
    return isinstance(tensor, DTensor) and any(isinstance(p, StridedShard) for p in tensor.placements)


def written_by_this_rank_alone(value: Any) -> bool:
    """Whether no other rank saves the chunks of ``value`` this rank saves, so that DCP's global plan
    (which gives a chunk several ranks hold to one of them) keeps all of them here: a
    :class:`PieceSet` (replica pieces are never given to it), or a DTensor sharded over every mesh
    dim of more than one rank."""
    if isinstance(value, PieceSet):
        return True
    return isinstance(value, DTensor) and all(
        p.is_shard() or value.device_mesh.size(d) == 1 for d, p in enumerate(value.placements))


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus boxes of :class:`PieceSet` leaves, plus staging: after
    :meth:`stage` (and :meth:`stage_deferred`), every item this rank writes is resolved from a
    private copy, so the live tensors may change while the files are written."""

    def __init__(self, buffers: StagingBuffers | None = None) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self._buffers = buffers
        self._staged: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
        self._deferred: list[WriteItem] = []

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, PieceSet):
            return obj.box(index)
        return super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        staged = self._staged.get(write_item.index)
        if staged is not None:
            if isinstance(staged, io.BytesIO):
                staged.seek(0)
            return staged
        return super().resolve_data(write_item)

    def stage(self, defer: Callable[[torch.Tensor], bool] | None = None) -> None:
        """Copy everything this rank's plan writes off the live state (tensors to host memory, other
        values serialized now), except the tensors ``defer`` picks: those stay live until
        :meth:`stage_deferred`. Called on the local plan (a superset of what the final plan keeps)
        or after ``finish_plan``; :attr:`held` counts the bytes held once all is staged."""
        for item in self.plan.items:
            data = super().resolve_data(item)
            if isinstance(data, torch.Tensor) and defer is not None and defer(data):
                self._deferred.append(item)
                continue
            self._staged[item.index] = self._host_copy(item.index, data) if isinstance(data, torch.Tensor) else data
        if not self._deferred:
            self._staging_done()

    @property
    def deferred(self) -> bool:
        """Whether :meth:`stage` left tensors live for :meth:`stage_deferred`."""
        return bool(self._deferred)

    def stage_deferred(self, only: Callable[[Any], bool] | None = None) -> None:
        """Copy the tensors :meth:`stage` left live that the plan writes; after it, nothing written
        refers to live state. ``only``: copy just those whose state-dict value it picks, and leave
        the rest for the next call (before the global plan: the values it surely keeps)."""
        writes = {item.index for item in self.plan.items}
        left = []
        for item in self._deferred:
            if only is not None and not only(self.state_dict.get(item.index.fqn)):
                left.append(item)
            elif item.index in writes:
                self._staged[item.index] = self._host_copy(item.index, super().resolve_data(item))
        self._deferred = left
        if only is None:
            self._staging_done()

    def update_values(self, values: dict[str, Any]) -> None:
        """Replace the planned flat entries ``values`` (by flat key), staged or not."""
        self.state_dict.update(values)
        for item in self.plan.items:
            if item.index.fqn in values and item.index in self._staged:
                self._staged[item.index] = self.transform_object(item, values[item.index.fqn])

    @property
    def held(self) -> int:
        """Bytes of host memory the staged copies of what this rank writes hold."""
        writes = {item.index for item in self.plan.items}
        return sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else v.getbuffer().nbytes
                   for k, v in self._staged.items() if k in writes)

    def _host_copy(self, index: MetadataIndex, tensor: torch.Tensor) -> torch.Tensor:
        if self._buffers is not None:
            return self._buffers.copy(index, tensor)
        # a fresh contiguous host tensor: a view would drag its whole storage into the file
        return tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)

    def _staging_done(self) -> None:
        self.state_dict = {}  # drop the references to live state: only the copies are written
        if self._buffers is not None:
            self._buffers.release_unused()


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a state dict already flattened (by the caller, with DCP's
    own flattening), reading :class:`PieceSet` leaves box by box."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # the default set-up walks the state dict to materialize meta tensors, and replaces every
        # leaf it does not know (a PieceSet) with None; the state here is already flat and real
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, PieceSet):
            return obj.box(index)
        return super().lookup_tensor(index)
