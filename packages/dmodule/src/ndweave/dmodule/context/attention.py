"""Attention across the CP dim: this rank's queries against the whole sequence's keys and values.

Keys and values are all-gathered over CP (an autograd collective: their gradients come back as a
reduce-scatter, each rank receiving the sum over every rank's queries of its own tokens' share);
queries stay local, so activation memory outside attention divides by CP. Causal attention on CPU
needs no mask (:class:`_CausalBlocks`: block by block through the flash kernel, merged by
log-sum-exp); other masks are rebuilt from global positions (sliding window, documents), since a
mask the model builds for its local tokens cannot know them. Every
``F.scaled_dot_product_attention`` call inside ``ContextParallel.attention()`` takes this path (a
``TorchFunctionMode``, as torch's experimental ``context_parallel`` does), which is how a model needs
no change: the GPT, torch's modules and transformers' ``"sdpa"`` attention all call it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from ndweave.dmodule.context.layout import SequenceLayout
from ndweave.mesh import CONTEXT_DIM
from ndweave.mesh.collectives import all_gather_flat, reduce_scatter_flat
from ndweave.mesh.torch_compat import flash_attention_cpu, flash_attention_cpu_backward

__all__ = ["ATTENTION_BREAK", "ContextParallel", "ContextParallelError"]

#: Why ``torch.compile`` breaks a compiled block's graph at each attention inside ``cp.attention()``.
ATTENTION_BREAK = ("context parallel: attention gathers keys and values over the CP ranks (collectives in an "
                   "autograd function, blocks chosen by position); it runs eagerly between the block's graphs")


class ContextParallelError(ValueError):
    """What context parallelism cannot split, with the fix."""


class ContextParallel:
    """The sequence split over a CP mesh dim, and attention across it.

    ``mesh``: a 1-D mesh (the CP ranks) or a mesh with a ``"CP"`` dim. ``load_balance``: each rank a
    head and a tail chunk (causal work even; see :class:`SequenceLayout`). Typical use::

        cp = ContextParallel(mesh["CP"])
        ids, targets = cp.shard(ids), cp.shard(targets)              # (B, T / CP) each
        with cp.attention():                                         # causal masks from global positions
            logits = model(ids, position_ids=cp.position_ids(T))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())   # this rank's tokens' mean

    Every rank holds as many tokens, so the mean over CP ranks of their losses is the whole
    sequence's, and gradients are averaged over CP as over DP (``DDP`` over the DP x CP ranks).
    """

    def __init__(self, mesh: DeviceMesh, *, load_balance: bool = True) -> None:
        if mesh.ndim != 1:
            names = mesh.mesh_dim_names or ()
            if CONTEXT_DIM not in names:
                raise ContextParallelError(f"context parallel needs a 1-D mesh or one with a {CONTEXT_DIM!r} dim; "
                                           f"got dims {names}: pass mesh[{CONTEXT_DIM!r}]")
            mesh = mesh[CONTEXT_DIM]
        self.mesh = mesh
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.load_balance = load_balance
        self._state: dict | None = None  # inside attention(): its masks and calls (see attend)

    def layout(self, seq_len: int) -> SequenceLayout:
        """The split of a ``seq_len``-token sequence (raises if ``2 * CP`` does not divide it)."""
        return SequenceLayout(seq_len, self.size, self.load_balance)

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence ``tensor`` (ids, targets, masks' document ids)."""
        return self.layout(tensor.shape[dim]).shard(tensor, self.rank, dim)

    def unshard(self, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence on every rank from each rank's shard (for evaluation, generation)."""
        gathered = _GatherSequence.apply(local, self.mesh.get_group(), dim % local.ndim)
        return self.layout(local.shape[dim] * self.size).unshard(gathered, dim)

    def position_ids(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens, ``(1, seq_len / CP)``: pass them as ``position_ids``
        (rotary and learned position embeddings then see where each token really is)."""
        return self.layout(seq_len).positions(self.rank, device).unsqueeze(0)

    @contextmanager
    def attention(self, *, window: int | None = None, documents: torch.Tensor | None = None,
                  replace_model_mask: bool = False) -> Iterator[None]:
        """Within it, ``F.scaled_dot_product_attention`` attends across CP. ``window``: a sliding window
        (keys at most ``window - 1`` positions before a query, and not after it when causal).
        ``documents``: ``(B, T)`` document ids of the *whole* sequences (packed batches): a query sees
        only its own document's keys. A model's own ``attn_mask`` was built for its local tokens and
        is refused, unless ``replace_model_mask=True`` says these arguments (with ``is_causal``) mean
        what it meant (transformers builds one for a sliding window: pass ``window=`` and this)."""
        if window is not None and window < 1:
            raise ContextParallelError(f"window={window}: a sliding window holds at least one position")
        outer, self._state = self._state, {"masks": {}, "calls": 0}
        try:
            with _Attention(self, window, documents, replace_model_mask):
                yield
            calls = self._state["calls"]
        finally:
            self._state = outer
        if not calls:  # (each rank attended to its own tokens only: wrong, and silently so)
            raise ContextParallelError(
                "no F.scaled_dot_product_attention ran inside cp.attention(), so no attention was split across CP and "
                "each rank attended to its own tokens only. Attention written by hand (matmul, softmax, matmul: "
                "transformers' \"eager\", Gemma 2's soft-capping) is not split by CP yet: use the model's SDPA "
                "attention (transformers: attn_implementation=\"sdpa\")")

    @torch.compiler.disable(reason=ATTENTION_BREAK)
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
               *, window: int | None = None, documents: torch.Tensor | None = None,
               replace_model_mask: bool = False) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` for this rank's tokens across CP (what ``attention()`` calls).
        Inside ``attention()`` the masks it builds are kept by what they depend on and reused by later
        calls (every layer then shares one mask, which autograd saves once, not once per layer), and its
        calls are counted. (That state is read here only, eagerly: a compiled caller's guards never see
        it, so nothing compiles again.)"""
        state = self._state
        if state is not None:
            state["calls"] += 1
        masks = state["masks"] if state is not None else None
        if attn_mask is not None and not replace_model_mask:
            raise ContextParallelError(
                f"scaled_dot_product_attention got an attn_mask of shape {tuple(attn_mask.shape)} under context "
                "parallel: a mask the model built for its local tokens cannot say which of the whole sequence's keys "
                "a query sees. Let the model attend without one (is_causal, or nothing for bidirectional) and say "
                "what it means with ContextParallel.attention(documents=..., window=..., replace_model_mask=True)")
        if attn_mask is not None:  # (a causal model that builds its own mask passes is_causal=False with it)
            is_causal = is_causal or self._causal_mask(attn_mask)
        local = query.shape[-2]
        if key.shape[-2] != local:
            raise ContextParallelError(
                f"scaled_dot_product_attention with {local} queries and {key.shape[-2]} keys under context parallel: "
                "cross-attention to another sequence (or a KV cache) is not split by CP; run it outside "
                "ContextParallel.attention()")
        wrap = None
        if isinstance(query, DTensor):  # (heads sharded over TP: attention is per head, so local tensors)
            mesh, placements = query.device_mesh, query.placements
            query, key, value = (t.to_local() if isinstance(t, DTensor) else t for t in (query, key, value))
            wrap = lambda out: DTensor.from_local(out, mesh, placements, run_check=False)  # noqa: E731
        layout = self.layout(local * self.size)
        if is_causal and window is None and documents is None and not dropout_p and query.device.type == "cpu":
            # no mask at all: per query chunk, a block of the keys wholly before it and its own chunk's
            # causal diagonal, through CPU's flash kernel, merged by log-sum-exp
            out = _CausalBlocks.apply(query, key, value, self.mesh.get_group(), _causal_blocks(layout, self.rank), scale)
            return wrap(out) if wrap else out
        keys, values = (_GatherSequence.apply(t, self.mesh.get_group(), t.ndim - 2) for t in (key, value))
        built = (layout.seq_len, query.dtype, query.device, is_causal, window, None if documents is None else id(documents))
        mask = masks.get(built) if masks is not None else None
        if mask is None:
            mask = self._mask(layout, query.device, is_causal, window, documents)
            if mask is not None:  # (additive, in the query's dtype: SDPA would convert a bool one on every call)
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
            if masks is not None:
                masks[built] = mask
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=enable_gqa)
        return wrap(out) if wrap else out

    @staticmethod
    def _causal_mask(mask: torch.Tensor) -> bool:
        """Whether a model's local mask hides every later key (its upper triangle all masked)."""
        square = mask[..., -mask.shape[-1]:, :]
        later = torch.ones(square.shape[-2:], dtype=torch.bool, device=mask.device).triu(1)
        hidden = ~square if mask.dtype == torch.bool else square < torch.finfo(mask.dtype).min / 2
        return bool(hidden[..., later].all())

    def _mask(self, layout: SequenceLayout, device: torch.device, causal: bool, window: int | None,
              documents: torch.Tensor | None) -> torch.Tensor | None:
        """True where a query (rows: this rank's tokens) may see a key (columns: the gathered order)."""
        q = layout.positions(self.rank, device)[:, None]
        k = layout.gathered_positions(device)[None, :]
        mask = (k <= q) if causal else None
        if window is not None:
            near = (q - k < window) & (k - q < (1 if causal else window))
            mask = near if mask is None else mask & near
        if documents is not None:
            if documents.shape[-1] != layout.seq_len:
                raise ContextParallelError(f"documents of shape {tuple(documents.shape)}: pass the whole sequences' "
                                           f"document ids, (batch, {layout.seq_len}), not this rank's shard")
            documents = documents.to(device)
            same = (layout.shard(documents, self.rank, -1)[..., :, None]
                    == documents[..., k[0]][..., None, :])[:, None]  # (B, 1, local, T)
            mask = same if mask is None else mask & same
        return mask


def _gather(local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every CP rank's ``local`` concatenated on ``dim`` in rank order."""
    flat = local.movedim(dim, 0).contiguous()
    out = flat.new_empty((dist.get_world_size(group) * flat.shape[0], *flat.shape[1:]))
    all_gather_flat(out, flat, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(whole: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's part (on ``dim``, rank order) of ``whole`` summed over the CP ranks."""
    flat = whole.movedim(dim, 0).contiguous()
    out = flat.new_empty((flat.shape[0] // dist.get_world_size(group), *flat.shape[1:]))
    reduce_scatter_flat(out, flat, group=group)
    return out.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    """:func:`_gather`; backward: each rank gets the sum, over every rank's use, of its own tokens'
    gradient (:func:`_reduce_scatter`)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(local, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


def _causal_blocks(layout: SequenceLayout, rank: int) -> list[tuple[slice, list[tuple[slice, bool]]]]:
    """Per chunk ``rank`` holds: its rows among the rank's tokens, and the chunks of keys its queries see,
    each as rows of the gathered keys (rank order): every chunk before it wholly, its own causally."""
    size = layout.seq_len // layout.pieces
    held = [c for r in range(layout.cp) for c in layout.chunks(r)]  # the gathered order: rank by rank, in its order
    where = {c: slice(i * size, (i + 1) * size) for i, c in enumerate(held)}  # chunk -> its rows
    return [(slice(i * size, (i + 1) * size), [*((where[c], False) for c in range(chunk)), (where[chunk], True)])
            for i, chunk in enumerate(layout.chunks(rank))]


class _CausalBlocks(torch.autograd.Function):
    """Causal attention of this rank's query chunks over the whole sequence's keys, without a mask.
    Forward: the keys and values gathered over CP; each (query chunk, key chunk) block through CPU's
    flash kernel; the blocks' outputs merged by their log-sum-exps. Saved: the local queries, keys and
    values, the merged output and log-sum-exp (no T x T weights, and not the gathered keys: backward
    gathers them again, as ring attention passes them round again). Backward: each block's gradients
    from the kernel's backward given the *merged* output and log-sum-exp, which normalize its softmax
    over every key; the keys' and values' reduce-scattered back to the ranks that hold them."""

    @staticmethod
    def forward(ctx, query, key, value, group, blocks, scale):
        dim = key.ndim - 2
        keys, values = _gather(key, group, dim), _gather(value, group, dim)
        outs, lses = [], []
        for rows, seen in blocks:
            q = query[..., rows, :]
            parts = [flash_attention_cpu(q, keys[..., cols, :], values[..., cols, :], is_causal=causal, scale=scale)
                     for cols, causal in seen]
            lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
            outs.append(sum(torch.exp(part_lse - lse).unsqueeze(-1).to(out.dtype) * out for out, part_lse in parts))
            lses.append(lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.blocks, ctx.scale = group, blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        dim = key.ndim - 2
        keys, values = _gather(key, ctx.group, dim), _gather(value, ctx.group, dim)
        grad_q, grad_k, grad_v = torch.zeros_like(query), torch.zeros_like(keys), torch.zeros_like(values)
        grad = grad.contiguous()
        for rows, seen in ctx.blocks:
            for cols, causal in seen:
                gq, gk, gv = flash_attention_cpu_backward(
                    grad[..., rows, :].contiguous(), query[..., rows, :].contiguous(), keys[..., cols, :].contiguous(),
                    values[..., cols, :].contiguous(), out[..., rows, :].contiguous(), lse[..., rows].contiguous(),
                    causal, scale=ctx.scale)
                grad_q[..., rows, :] += gq
                grad_k[..., cols, :] += gk
                grad_v[..., cols, :] += gv
        del keys, values
        return grad_q, _reduce_scatter(grad_k, ctx.group, dim), _reduce_scatter(grad_v, ctx.group, dim), None, None, None


class _Attention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :meth:`ContextParallel.attend`."""

    def __init__(self, cp: ContextParallel, window: int | None, documents: torch.Tensor | None,
                 replace_model_mask: bool) -> None:
        super().__init__()
        self.cp, self.window, self.documents, self.replace = cp, window, documents, replace_model_mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.cp.attend(*args, **kwargs, window=self.window, documents=self.documents,
                                  replace_model_mask=self.replace)
        return func(*args, **kwargs)
