"""``construct_pipeline_stage``: this rank's stage chunk(s), each the original model minus the layers
of other stages, so every parameter keeps its original FQN.

A chunk is a *skeleton copy* of the model: the modules on the path from the root to a removed layer
are shallow copies (own child / parameter / buffer dicts, same attributes), the removed layer's slot
holds a :class:`StagePlaceholder`, and every kept layer is the original module object. Nothing is
allocated or initialized: a ``meta``-device or ``deferred_init`` model stays so, and only the kept
layers' tensors are reachable from the chunk. The model passed in is left untouched.

With ``example_inputs`` the root ``forward`` is traced once (:mod:`ndweave.pipeline.trace`) and cut
in execution order; each chunk's ``forward`` then runs only its stage's part of the graph
(:mod:`ndweave.pipeline.program`). Without, every chunk runs the whole root ``forward``, other
stages' layers passing their input through.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ndweave.mesh import ParallelMesh, resolve_mesh
from ndweave.mesh.contracts import finish_grad_sync, mark_removed_modules
from ndweave.mesh.torch_compat import local_tensor, own_parameters, own_submodules
from ndweave.pipeline.chain import Chain, chained_children, run_chain_stage
from ndweave.pipeline.cut import TracedCut
from ndweave.pipeline.dry_run import check_stages_run
from ndweave.pipeline.inputs import ModelInputs
from ndweave.pipeline.plan import PipelineParallelPlan, ResolvedPlan, resolve_plan
from ndweave.pipeline.program import run_as_stage, stage_program
from ndweave.pipeline.split import assign_stages, holds_layer_container, model_layers
from ndweave.pipeline.stage_io import StageIO
from ndweave.pipeline.ties import SharedParam, find_shared_params

__all__ = ["PipeModule", "StagePlaceholder", "construct_pipeline_stage"]


class LoadResult(NamedTuple):
    """What ``PipeModule.load_state_dict`` returns (the fields of torch's own result)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class StagePlaceholder(nn.Module):
    """Stands where another stage's layer was: no parameters, hands its first input through.

    Loops over a layer list (``for block in self.h: x = block(x)``) and calls of a final norm or head
    then run unchanged on a stage that does not hold them.
    """

    def __init__(self, fqn: str, stage: int) -> None:
        super().__init__()
        self.fqn = fqn
        self.stage = stage

    def forward(self, *args, **kwargs):
        if args:
            return args[0]
        if kwargs:
            return next(iter(kwargs.values()))
        raise TypeError(f"StagePlaceholder for {self.fqn!r} (stage {self.stage}) was called without inputs")

    def extra_repr(self) -> str:
        return f"{self.fqn!r} is on stage {self.stage}"


class PipeModule(nn.Module):
    """This rank's pipeline stage chunks: ``module.chunks``, ``module[i]``, ``len(module)``.

    Chunk ``i`` runs stage ``module.stage_indices[i]``. Chunks can be replaced in place, e.g. by their
    data-parallel wrapper: ``module[i] = DDP(module[i], mesh["DP"])``; the engine reads them when it is
    built. ``named_parameters()`` / ``state_dict()`` use the model's original FQNs (no ``chunks.i.``
    prefix); ``load_state_dict`` takes a whole-model state dict and loads what each chunk holds.
    """

    def __init__(self, chunks: list[nn.Module], stage_indices: list[int], stage_layers: list[list[str]],
                 resolved: ResolvedPlan, shared_params: list[SharedParam], stage_io: list[StageIO | None],
                 stage_seconds: list[float] | None = None) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stage_indices = tuple(stage_indices)
        self.stage_layers = stage_layers
        """The layer FQNs of every stage of the pipeline (not only this rank's)."""
        self.resolved_plan = resolved
        self.shared_params = shared_params
        """Weights held by several stages (tied embedding and LM head), all stages' view."""
        self.stage_seconds = stage_seconds
        """Each stage's measured forward + backward seconds on the example (``split_method="time"``)."""
        self.stage_io = stage_io
        """What crosses each cut of a traced model: ``stage_io[s]`` is what stage ``s`` receives
        (``None`` for stage 0, and for every stage of a model cut without ``example_inputs``)."""

    @property
    def num_stages(self) -> int:
        return self.resolved_plan.num_stages

    def __getitem__(self, index: int) -> nn.Module:
        return self.chunks[index]

    def __setitem__(self, index: int, chunk: nn.Module) -> None:
        self.chunks[index] = chunk

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.chunks)

    def forward(self, *args, chunk_id: int | None = None, **kwargs):
        """Run one chunk directly (veScale's ``forward(x, chunk_id=)``): ``chunk_id`` indexes this
        rank's chunks and may be left out when there is one. A traced chunk takes what its stage
        receives (the model's inputs on the first stage, positional or by keyword, ``stage_io``'s
        tensors later) and returns what
        it sends (a tensor, or a tuple when several cross; the model's output on the last stage).
        Training runs through ``PipeEngine``."""
        if chunk_id is None and len(self.chunks) > 1:
            raise ValueError(f"this rank holds {len(self.chunks)} chunks (stages {list(self.stage_indices)}); "
                             "pass chunk_id=")
        chunk = self.chunks[chunk_id or 0]
        out = chunk(*args, **kwargs)
        program = stage_program(chunk)
        if program is not None and program.outputs is not None and len(out) == 1:
            return out[0]  # one tensor crossing: itself, as the model computed it
        return out

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Every chunk's parameters under their original FQNs."""
        seen: set[int] = set()
        for chunk in self.chunks:
            for name, param in chunk.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
                if remove_duplicate and id(param) in seen:
                    continue
                seen.add(id(param))
                yield name, param

    def state_dict(self, *args, **kwargs):
        """Every chunk's state under its original FQN (what one device's ``model.state_dict()`` holds
        of this rank's stages)."""
        merged: dict = {}
        for chunk in self.chunks:
            merged.update(chunk.state_dict(*args, **kwargs))
        return merged

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load each chunk's entries from a whole-model (or this rank's) ``state_dict``; keys of other
        stages are ignored. ``strict``: every key a chunk holds must be present."""
        missing: list[str] = []
        for chunk in self.chunks:
            own = chunk.state_dict(keep_vars=True)
            result = chunk.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False, assign=assign)
            missing.extend(result.missing_keys)
        if strict and missing:
            raise RuntimeError(f"PipeModule.load_state_dict: missing keys {missing}")
        return LoadResult(missing, [])

    def finish_grad_sync(self) -> None:
        """Finish every chunk's pending grad sync (``GradSyncable``), for optimizers given the module."""
        finish_grad_sync(list(self.chunks))


def construct_pipeline_stage(model: nn.Module, plan: PipelineParallelPlan,
                             mesh: ParallelMesh | DeviceMesh | None = None, *,
                             example_inputs: ModelInputs | None = None) -> PipeModule:
    """This rank's stage chunk(s) of ``model`` under ``plan``, over the ``"PP"`` dim of ``mesh``
    (default: the default ``DEVICE_MESH``)::

        module = construct_pipeline_stage(GPT(config), plan, mesh, example_inputs=idx[:2])
        module[0]                        # the GPT with other stages' blocks replaced by placeholders
        [n for n, _ in module.named_parameters()]   # original FQNs: "transformer.h.2.attn.q_proj.weight"

    ``example_inputs``: the model's inputs for one micro-batch, real or ``meta`` (only shapes and
    dtypes are used): a tensor, a tuple (positional) or a dict of keyword arguments of the forward
    (``{"input_ids": ids, "attention_mask": mask}``; parameters left out keep their defaults, and a
    value that is no tensor, such as ``use_cache=False``, is fixed in the trace). With them the root
    ``forward`` is traced once and cut where the layers *run*: any model, split points naming any
    module, the work the forward does between layers run once on the stage that owns it, several
    values between stages (``module.stage_io``); a layer or weight the forward uses on several stages
    (an encoder's and a decoder's shared embedding, a relative-position table every layer reads) is
    held by each, kept equal as tied weights are. The engine's batches then take the same inputs.
    Without them the model is cut in registration order and every stage runs the whole root
    ``forward`` (its layers in containers, later stages taking the hidden states).
    """
    pp_mesh = resolve_mesh(mesh, "PP")
    resolved = resolve_plan(plan, pp_mesh.size())
    mine = resolved.stages_of(pp_mesh.get_local_rank())
    cut = cut_model(model, plan, resolved, example_inputs, pp_mesh.device_type)
    chunks = [cut.chunk(model, stage) for stage in mine]
    copies = cut.traced.copies if cut.traced is not None else {}
    shared = find_shared_params(model, cut.stage_layers, plan.shared_modules, copies)
    return PipeModule(chunks, mine, cut.stage_layers, resolved, shared, cut.stage_io, cut.seconds)


class ModelCut(NamedTuple):
    """Where a model is cut into stages, decided before any chunk exists (no process, no allocation)."""

    layers: list[str]
    stage_layers: list[list[str]]
    stage_io: list[StageIO | None]
    seconds: list[float] | None
    traced: TracedCut | None
    chain: Chain | None = None
    """A model cut without shapes whose forward chains its children: each chunk runs from its first."""

    def chunk(self, model: nn.Module, stage: int) -> nn.Module:
        """Stage ``stage``'s chunk of ``model`` (a skeleton copy sharing its tensors)."""
        if self.traced is None:
            chunk = _build_chunk(model, self.layers, self.stage_layers, stage)
            if self.chain is None or stage == 0:
                return chunk
            return run_chain_stage(chunk, self.chain, self.stage_layers[stage][0])
        chunk = _build_chunk(model, self.layers, self.stage_layers, stage, self.traced.unread_params(stage),
                             self.traced.borrowed[stage])
        return run_as_stage(chunk, self.traced.programs[stage])


def cut_model(model: nn.Module, plan: PipelineParallelPlan, resolved: ResolvedPlan,
              example_inputs: ModelInputs | None, device_type: str) -> ModelCut:
    """The stages of ``model`` under ``plan`` (traced with ``example_inputs``, else by registration order)."""
    _check_shared_modules(model, plan)
    if example_inputs is None:
        if plan.split_points is None and plan.split_method == "time":
            raise ValueError("split_method='time' times the layers of the traced forward: pass example_inputs= "
                             "to construct_pipeline_stage")
        chain = None if holds_layer_container(model) else chained_children(model)[0]
        layers = chain.layers if chain is not None else model_layers(model)  # (no chain: model_layers says why)
        stage_layers = assign_stages(model, resolved.num_stages, plan.split_points, layers)
        cut = ModelCut(layers, stage_layers, [None] * resolved.num_stages, None, None, chain)
        if chain is None:  # (a chain runs each stage from its first layer: nothing to try)
            check_stages_run(model, lambda stage: cut.chunk(model, stage), resolved.num_stages)
        return cut
    traced = TracedCut(model, resolved.num_stages, plan, example_inputs, device_type)
    return ModelCut(traced.layers, traced.stage_layers, traced.stage_io, traced.stage_seconds, traced)


def _build_chunk(model: nn.Module, layers: list[str], stage_layers: list[list[str]], stage: int,
                 unread_params: list[str] = (), borrowed: list[str] = ()) -> nn.Module:
    stage_of = {fqn: s for s, held in enumerate(stage_layers) for fqn in held}
    removed = [fqn for fqn in layers
               if stage_of[fqn] != stage and fqn not in borrowed and _has_params(model.get_submodule(fqn))]
    root = _skeleton(model)
    copies: dict[str, nn.Module] = {"": root}
    aliases: dict[int, list[str]] = {}  # a module held under several names (veScale's FourMLP: mlp1 and sequence.0)
    for fqn, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(fqn)
    for fqn in removed:
        for path in aliases[id(model.get_submodule(fqn))]:
            parent_fqn, _, name = path.rpartition(".")
            own_submodules(_copied_path(copies, parent_fqn))[name] = StagePlaceholder(fqn, stage_of[fqn])
    for fqn in unread_params:
        parent_fqn, _, name = fqn.rpartition(".")
        del own_parameters(_copied_path(copies, parent_fqn))[name]
    gone: dict[str, str] = {}
    for fqn in removed:
        for sub, module in model.get_submodule(fqn).named_modules(prefix=fqn):
            gone[sub] = type(module).__name__
    return mark_removed_modules(root, gone)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _copied_path(copies: dict[str, nn.Module], fqn: str) -> nn.Module:
    """The skeleton copy of the module at ``fqn``, copying its ancestors first where needed."""
    if fqn in copies:
        return copies[fqn]
    parent_fqn, _, name = fqn.rpartition(".")
    parent = _copied_path(copies, parent_fqn)
    copies[fqn] = own_submodules(parent)[name] = _skeleton(own_submodules(parent)[name])
    return copies[fqn]


def _skeleton(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose child, parameter, buffer and hook tables are its own, so
    replacing a child in the copy leaves the original alone. Tensors are shared, never copied."""
    new = copy.copy(module)
    for key, value in new.__dict__.items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
    return new


def _check_shared_modules(model: nn.Module, plan: PipelineParallelPlan) -> None:
    names = {fqn for fqn, _ in model.named_modules()} | {fqn for fqn, _ in model.named_parameters(remove_duplicate=False)}
    for group in plan.shared_modules:
        for fqn in group:
            if fqn not in names:
                near = difflib.get_close_matches(fqn, sorted(names), n=5, cutoff=0.3)
                raise ValueError(f"shared_modules names {fqn!r}, which {type(model).__name__} does not have; nearest: {near}")


def chunk_device(chunk: nn.Module, mesh_device_type: str) -> torch.device:
    """Where a chunk computes: its first tensor's device, else the mesh's device type."""
    for t in (*chunk.parameters(), *chunk.buffers()):
        device = local_tensor(t).device  # a DTensor's shard lives on the mesh's device
        if device.type != "meta":
            return device
    if mesh_device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh_device_type, torch.accelerator.current_device_index())
