"""Attention written by hand (matmul, softmax, matmul) across the CP dim.

transformers' ``"eager"`` attention, Gemma 2's soft-capped scores and a user's own module compute
``softmax(q @ k^T * scale + mask) @ v`` with plain ops, not ``F.scaled_dot_product_attention``. Inside
``ContextParallel.attention()`` those ops are recognised by their shapes as they run:

- ``q @ k^T`` with as many keys as queries, ``(..., L, d) @ (..., d, L)``: the keys are gathered over
  CP, so the scores are this rank's ``L`` queries against the whole sequence's ``T`` keys, ``(..., L, T)``;
- a mask the model combines with those scores (``+``, ``torch.where``, ``masked_fill``) was built for
  ``L`` local keys: it is replaced by the one built from global positions, as for SDPA;
- ``weights @ v`` with ``T`` weights against ``L`` values: the values are gathered.

What runs between (scaling, soft-capping, softmax, dropout) is elementwise or per row and runs on the
``(L, T)`` scores as written. The gathers are autograd collectives: the keys' and values' gradients come
back reduce-scattered, as on the SDPA path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ndweave.dmodule.context.exchange import ATTENTION_BREAK, GatherSequence
from ndweave.dmodule.context.layout import ContextParallelError

if TYPE_CHECKING:
    from ndweave.dmodule.context.attention import ContextParallel

__all__ = ["HandWritten"]

#: What multiplies queries by keys, or weights by values.
MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm})
_ADDS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
                   torch.Tensor.__iadd__})
_WHERES = frozenset({torch.where, torch.Tensor.where})
_FILLS = frozenset({torch.Tensor.masked_fill, torch.Tensor.masked_fill_})
#: What combines scores with a mask.
MASKINGS = _ADDS | _WHERES | _FILLS


class HandWritten:
    """One ``cp.attention()``'s hand-written attention. Which ops are attention's is decided from shapes
    alone (so a compiled block's guards are static); what changes them runs eagerly, between the block's
    graphs (``ATTENTION_BREAK``), and so does the one piece of state: whether a mask met the last scores
    (``window=`` and ``documents=`` need the model to apply one)."""

    def __init__(self, cp: ContextParallel, window: int | None, documents: torch.Tensor | None,
                 replace_model_mask: bool) -> None:
        self.cp, self.window, self.documents, self.replace = cp, window, documents, replace_model_mask
        self.masked = False

    def matmul(self, func, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
        """``a @ b`` across CP if it is attention's, else None (not this module's to change)."""
        if a.ndim < 3 or b.ndim != a.ndim:
            return None
        if a.shape[-1] == self.cp.size * b.shape[-2]:  # (weights over T keys @ L values: wrong shapes as written)
            return self._weighted(func, a, b)
        if a.shape[-2] == b.shape[-1] > 1 and a.shape[-1] == b.shape[-2]:  # (q @ k^T: as many keys as queries)
            return self._scores(func, a, b)
        return None

    def masking(self, func, args: tuple, kwargs: dict):
        """``func(*args, **kwargs)`` with a local mask on the scores replaced by the global one, or
        ``NotImplemented`` when no argument is the scores with such a mask."""
        if kwargs:
            return NotImplemented
        shapes = [arg.shape if isinstance(arg, torch.Tensor) else None for arg in args]
        scores = [i for i, shape in enumerate(shapes) if shape is not None and len(shape) >= 2
                  and shape[-1] == self.cp.size * shape[-2]]
        masks = [i for i, shape in enumerate(shapes) if shape is not None and len(shape) >= 2 and scores
                 and shape[-2:] == (shapes[scores[0]][-2],) * 2]
        if not scores or not masks:  # ((L, T) against (L, L): wrong shapes as written)
            return NotImplemented
        return self._replace(func, args, scores[0], masks[0])

    @torch.compiler.disable(reason=ATTENTION_BREAK)
    def _scores(self, func, query: torch.Tensor, key_t: torch.Tensor) -> torch.Tensor:
        """This rank's queries against the whole sequence's keys, ``(..., L, T)``."""
        self.cp._attended()
        self.masked = False
        return func(query, self._gather(key_t, key_t.ndim - 1))

    @torch.compiler.disable(reason=ATTENTION_BREAK)
    def _weighted(self, func, weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The weights over the whole sequence's keys times its values."""
        if (self.window is not None or self.documents is not None) and not self.masked:
            raise ContextParallelError(
                "the model's hand-written attention applied no mask to its scores, so window= and documents= "
                "had nothing to replace: under context parallel they replace the mask the model adds")
        return func(weights, self._gather(value, value.ndim - 2))

    @torch.compiler.disable(reason=ATTENTION_BREAK)
    def _replace(self, func, args: tuple, at_scores: int, at_mask: int):
        """``func(*args)`` with ``args[at_mask]``, a mask for local keys, replaced by the global one."""
        mask = args[at_mask]
        local = mask.shape[-1]
        if not self.replace:
            raise ContextParallelError(
                f"the model's hand-written attention combines its scores with a mask of shape {tuple(mask.shape)} "
                "built for its local tokens, which cannot say which of the whole sequence's keys a query sees. "
                "Say what it means with ContextParallel.attention(documents=..., window=..., replace_model_mask=True)")
        # where(seen, scores, fill), where(hidden, fill, scores), masked_fill(scores, hidden, fill)
        how = "additive" if func in _ADDS else "seen" if func in _WHERES and at_scores == 1 else "hidden"
        device, causal = mask.device, self.cp._reads_causal(mask, how)
        ours = self.cp._visible(local * self.cp.size, device, causal, self.window, self.documents, in_order=True)
        if ours is None:  # (bidirectional, every key seen)
            ours = self.cp._cached(("all", local, device), lambda: torch.ones(
                local, local * self.cp.size, dtype=torch.bool, device=device))
        if func in _ADDS and mask.dtype != torch.bool:
            seen = ours
            ours = self.cp._cached(("additive", mask.dtype, id(seen)), lambda: torch.zeros(
                seen.shape, dtype=mask.dtype, device=device).masked_fill_(~seen, torch.finfo(mask.dtype).min))
        elif func in _FILLS or (func in _WHERES and at_scores != 1):
            seen = ours
            ours = self.cp._cached(("hidden", id(seen)), lambda: ~seen)
        if isinstance(mask, DTensor):
            ours = DTensor.from_local(ours, mask.device_mesh, mask.placements, run_check=False)
        self.masked = True
        return func(*args[:at_mask], ours, *args[at_mask + 1:])

    def _gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """``tensor``'s whole sequence on ``dim``, in order, gathered over CP (a DTensor's local heads).
        (In order, not the gathered order SDPA's path keeps: a float32 softmax then sums each row as one
        process does, bit for bit.)"""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        whole = GatherSequence.apply(local, self.cp.mesh.get_group(), dim)
        whole = self.cp.layout(whole.shape[dim]).unshard(whole, dim)
        if isinstance(tensor, DTensor):
            return DTensor.from_local(whole, tensor.device_mesh, tensor.placements, run_check=False)
        return whole
