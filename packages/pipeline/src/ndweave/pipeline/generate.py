"""Autoregressive generation through a pipelined model: a forward relay, one token per relay.

A schedule splits a fixed-shape batch into micro-batches; decoding runs one sequence that grows by a
token per step, so each step is a plain relay instead: the first stage runs on the tokens so far,
each stage sends what crosses its cut to the next (shapes first, since they change every step), the
last stage picks the next token and broadcasts it over the PP group, and every PP rank appends it.
Each rank runs its stages in order, so interleaved and V-shaped layouts relay the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.mesh.torch_compat import local_shape_and_offset

from ndweave.pipeline.agree import every_pp_rank
from ndweave.pipeline.engine import PipeEngine
from ndweave.pipeline.stages import mesh_lookup

__all__ = ["generate"]


def generate(engine: PipeEngine, idx: torch.Tensor, max_new_tokens: int, *, max_seq_len: int | None = None,
             temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """``max_new_tokens`` tokens after ``idx`` (B, T) from the pipelined model, on every PP rank::

        engine = PipeEngine(module, mesh, loss_fn, plan)
        tokens = generate(engine, prompt, max_new_tokens=50, max_seq_len=config.block_size)

    The last stage's output must be (or hold first) logits of shape (B, T, vocab). ``temperature=0``
    picks the most likely token (greedy, equal to one process token for token); above 0 it samples
    from ``softmax(logits / temperature)`` with ``generator`` (on the last stage). ``max_seq_len``:
    the model sees at most that many last tokens. Every PP rank passes the same ``idx``; it runs under
    ``no_grad``, with the chunks in the mode they are in (``module.eval()`` first).
    """
    engine._check_usable()
    asked = {"prompt shape": tuple(idx.shape), "max_new_tokens": max_new_tokens, "max_seq_len": max_seq_len,
             "temperature": temperature}
    for rank, other in enumerate(every_pp_rank(asked, engine._group)):  # fewer tokens on one would leave the others waiting
        if other != asked:
            name = next(k for k in asked if other[k] != asked[k])
            raise ValueError(f"generate: PP rank {rank} was given {name}={other[name]}, this rank {asked[name]}; "
                             "every PP rank must pass the same prompt and arguments")
    engine._blame.reset()
    try:
        with torch.no_grad():
            return _decode(engine, idx, max_new_tokens, max_seq_len, temperature, generator)
    except Exception as failed:  # raised on every PP rank, as a training step's failure is
        engine._fail(failed)


def _decode(engine: PipeEngine, idx: torch.Tensor, max_new_tokens: int, max_seq_len: int | None,
            temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    source = engine._rank_of_stage(engine.resolved.num_stages - 1)
    tokens = idx
    for _ in range(max_new_tokens):
        window = tokens if max_seq_len is None else tokens[:, -max_seq_len:]
        logits = _relay(engine, window)
        if logits is not None:
            nxt = _pick(logits, temperature, generator)
        else:
            nxt = torch.empty((idx.shape[0], 1), dtype=torch.long, device=idx.device)
        if engine.pp_mesh.size() > 1:
            dist.broadcast(nxt, src=source, group=engine._group)
        tokens = torch.cat([tokens, nxt.to(tokens.device)], dim=1)
    return tokens


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()  # vocabulary-parallel logits (loss_parallel)
    scores = logits[:, -1, :]
    if temperature == 0:
        return scores.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(scores.double() / temperature, dim=-1)
    drawn = torch.multinomial(probs.to(generator.device if generator else probs.device), 1, generator=generator)
    return drawn.to(scores.device)


def _relay(engine: PipeEngine, window: torch.Tensor) -> torch.Tensor | None:
    """One forward through every stage; the last stage's logits on its rank, ``None`` elsewhere."""
    last = engine.resolved.num_stages - 1
    me = torch.distributed.get_rank()
    handed: tuple = ()
    for stage in engine.stages:  # this rank's stages, in increasing order
        s = stage.stage_index
        if s == 0:
            args = (window,)
            stage.submod.layout = None  # the window alone, whatever inputs training passed
        elif engine._rank_of_stage(s - 1) == me:
            args = handed
        else:
            args = _receive(engine, stage, engine._rank_of_stage(s - 1))
        stage.submod.micro_batch = 0  # one sequence (named so if a forward raises)
        out = stage.submod(*args)
        out = out if isinstance(out, tuple) else (out,)
        if s == last:
            return out[0]
        if engine._rank_of_stage(s + 1) == me:
            handed = out
        else:
            _send(engine, out, engine._rank_of_stage(s + 1))
    return None


def _send(engine: PipeEngine, tensors: tuple, dst: int) -> None:
    group = engine._group
    metas = [(tuple(t.shape), t.dtype, tuple(t.placements), t.device_mesh.mesh_dim_names, tuple(t.stride()))
             if isinstance(t, DTensor) else (tuple(t.shape), t.dtype, None, None, None) for t in tensors]
    dist.send_object_list([metas], dst=dst, group=group)
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.numel():
            dist.send(local.contiguous(), dst=dst, group=group)


def _receive(engine: PipeEngine, stage, src: int) -> tuple:
    group = engine._group
    box: list = [None]
    dist.recv_object_list(box, src=src, group=group)
    chunk = engine.module.chunks[list(engine.module.stage_indices).index(stage.stage_index)]
    received = []
    for shape, dtype, placements, dims, stride in box[0]:
        mesh = None if placements is None else mesh_lookup(chunk)(dims)
        local = shape if mesh is None else local_shape_and_offset(shape, mesh, placements)[0]
        buffer = torch.empty(local, dtype=dtype, device=stage.device)
        if buffer.numel():
            dist.recv(buffer, src=src, group=group)
        if mesh is not None:  # a sequence-parallel shard arrives as a shard, as in training
            buffer = DTensor.from_local(buffer, mesh, placements, run_check=False, shape=shape, stride=stride)
        received.append(buffer)
    return tuple(received)
