"""Attention across the CP dim: this rank's queries against the whole sequence's keys and values.

Keys and values are all-gathered over CP (an autograd collective: their gradients come back as a
reduce-scatter, each rank receiving the sum over every rank's queries of its own tokens' share);
queries stay local, so activation memory outside attention divides by CP. Causal attention on CPU
needs no mask (:class:`_CausalBlocks`: block by block through the flash kernel, merged by
log-sum-exp); other masks are rebuilt from global positions (sliding window, documents), since a
mask the model builds for its local tokens cannot know them. Every
``F.scaled_dot_product_attention`` call inside ``ContextParallel.attention()`` takes this path (a
``TorchFunctionMode``, as torch's experimental ``context_parallel`` does), which is how a model needs
no change: the GPT, torch's modules and transformers' ``"sdpa"`` attention all call it. Attention
written by hand (matmul, softmax, matmul) is found by the same mode from its ops' shapes
(:mod:`~ndweave.dmodule.context.eager`); the exchanges are in :mod:`~ndweave.dmodule.context.exchange`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from ndweave.dmodule.context.eager import MASKINGS, MATMULS, HandWritten
from ndweave.dmodule.context.exchange import ATTENTION_BREAK, GatherSequence, gather, reduce_scatter
from ndweave.dmodule.context.layout import ContextParallelError, SequenceLayout
from ndweave.mesh import CONTEXT_DIM
from ndweave.mesh.torch_compat import flash_attention_cpu, flash_attention_cpu_backward

__all__ = ["ContextParallel"]

_SDPA = F.scaled_dot_product_attention  # torch's, whatever a caller sets F's attribute to meanwhile
_BACKWARDS = frozenset({torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward})


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
        gathered = GatherSequence.apply(local, self.mesh.get_group(), dim % local.ndim)
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
        if not calls and self.size > 1:  # (each rank attended to its own tokens only: wrong, and silently so)
            raise ContextParallelError(
                "no attention ran inside cp.attention(): neither F.scaled_dot_product_attention nor attention written "
                "by hand (q @ k^T with as many keys as queries, softmax, @ v), so nothing was split across CP and each "
                "rank attended to its own tokens only. Attention in another form (einsum, a fused kernel) is not "
                "split: use the model's SDPA attention (transformers: attn_implementation=\"sdpa\")")

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
        self._attended()
        local = query.shape[-2]
        # this rank's rows of a mask over the whole sequence (keys in order): the caller built it for CP
        whole = attn_mask is not None and attn_mask.shape[-1] == local * self.size
        if attn_mask is not None and not whole and not replace_model_mask:
            raise ContextParallelError(
                f"scaled_dot_product_attention got an attn_mask of shape {tuple(attn_mask.shape)} under context "
                "parallel: a mask the model built for its local tokens cannot say which of the whole sequence's keys "
                "a query sees. Let the model attend without one (is_causal, or nothing for bidirectional) and say "
                "what it means with ContextParallel.attention(documents=..., window=..., replace_model_mask=True), "
                f"or pass this rank's rows of the whole sequence's mask, (..., {local}, {local * self.size})")
        if key.shape[-2] != local:
            raise ContextParallelError(
                f"scaled_dot_product_attention with {local} queries and {key.shape[-2]} keys under context parallel: "
                "cross-attention to another sequence (or a KV cache) is not split by CP; run it outside "
                "ContextParallel.attention()")
        if attn_mask is not None and not whole:  # (a causal model that builds its own mask passes is_causal=False)
            is_causal = is_causal or self._reads_causal(attn_mask, "additive")
        wrap = None
        if isinstance(query, DTensor):  # (heads sharded over TP: attention is per head, so local tensors)
            mesh, placements = query.device_mesh, query.placements
            query, key, value = (t.to_local() if isinstance(t, DTensor) else t for t in (query, key, value))
            wrap = lambda out: DTensor.from_local(out, mesh, placements, run_check=False)  # noqa: E731
        layout = self.layout(local * self.size)
        if (is_causal and not whole and window is None and documents is None and not dropout_p
                and query.device.type in ("cpu", "meta")):  # (meta: a trace, an estimate of the CPU's)
            # no mask at all: per query chunk, a block of the keys wholly before it and its own chunk's
            # causal diagonal, through CPU's flash kernel, merged by log-sum-exp
            out = _CausalBlocks.apply(query, key, value, self.mesh.get_group(), _causal_blocks(layout, self.rank), scale)
            return wrap(out) if wrap else out
        keys, values = (GatherSequence.apply(t, self.mesh.get_group(), t.ndim - 2) for t in (key, value))
        if whole:  # (its columns to the gathered order; kept with it, so its id names it while cached)
            given = attn_mask.to_local() if isinstance(attn_mask, DTensor) else attn_mask
            visible = self._cached(("whole", id(given)), lambda: (given, self._model_visible(given).index_select(
                -1, layout.gathered_positions(given.device))))[1]
        else:
            visible = self._visible(layout.seq_len, query.device, is_causal, window, documents)
        mask = None if visible is None else self._cached(  # (additive: SDPA would convert a bool one on every call)
            ("additive", query.dtype, id(visible)),
            lambda: torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill_(~visible, float("-inf")))
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=enable_gqa)
        return wrap(out) if wrap else out

    def _attended(self) -> None:
        """Count an attention split across CP (``attention()`` raises if none was)."""
        if self._state is not None:
            self._state["calls"] += 1

    def _cached(self, key: tuple, build):
        """``build()``, kept inside ``attention()`` by what it depends on: every layer then shares one mask,
        which autograd saves once, not once per layer."""
        masks = self._state["masks"] if self._state is not None else {}
        if key not in masks:
            masks[key] = build()
        return masks[key]

    def _reads_causal(self, mask: torch.Tensor, how: str) -> bool:
        """Whether a model's local mask hides every later key. ``how`` it marks a seen key: ``"additive"``
        (0, or True for a bool mask; a bias refused), ``"seen"`` (True), ``"hidden"`` (False). Read once per
        mask inside ``attention()``: every layer passes the same one, and reading it waits for the device."""
        def read() -> tuple[torch.Tensor, bool]:
            visible = {"additive": self._model_visible, "seen": lambda m: m, "hidden": lambda m: ~m}[how](mask)
            return mask, self._causal_mask(visible)  # (the mask kept with it: its id names it while cached)

        return self._cached(("causal", id(mask), how), read)[1]

    @staticmethod
    def _model_visible(mask: torch.Tensor) -> torch.Tensor:
        """Where a model's (bool or additive) mask lets a query see a key. An additive one that adds
        anything but 0 there is a bias on the scores (relative positions, ALiBi), refused."""
        if mask.dtype == torch.bool:
            return mask
        visible = mask > torch.finfo(mask.dtype).min / 2
        if not mask.is_meta and bool((mask[visible] != 0).any()):
            raise ContextParallelError(
                f"the model adds a bias to its attention scores (a mask of shape {tuple(mask.shape)} with values other "
                "than 0 where keys are seen: relative positions or ALiBi) built for its local tokens: context parallel "
                "cannot split it; train this model without a CP dim")
        return visible

    @staticmethod
    def _causal_mask(visible: torch.Tensor) -> bool:
        """Whether a model's local mask (True: seen) hides every later key (its upper triangle)."""
        if visible.is_meta:  # (a trace on meta tensors, the pipeline's or the estimate's: read as causal)
            return True
        square = visible[..., -visible.shape[-1]:, :]
        later = torch.ones(square.shape[-2:], dtype=torch.bool, device=visible.device).triu(1)
        return not bool(square[..., later].any())

    def _visible(self, seq_len: int, device: torch.device, causal: bool, window: int | None,
                 documents: torch.Tensor | None, *, in_order: bool = False) -> torch.Tensor | None:
        """True where a query (rows: this rank's tokens) may see a key (columns: the gathered order, or
        the sequence's with ``in_order``); None where every query sees every key."""
        key = ("visible", seq_len, device, causal, window, None if documents is None else id(documents), in_order)
        return self._cached(key, lambda: self._mask(self.layout(seq_len), device, causal, window, documents, in_order))

    def _mask(self, layout: SequenceLayout, device: torch.device, causal: bool, window: int | None,
              documents: torch.Tensor | None, in_order: bool) -> torch.Tensor | None:
        """:meth:`_visible`, built."""
        q = layout.positions(self.rank, device)[:, None]
        k = (torch.arange(layout.seq_len, device=device) if in_order else layout.gathered_positions(device))[None, :]
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
        keys, values = gather(key, group, dim), gather(value, group, dim)
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
        keys, values = gather(key, ctx.group, dim), gather(value, ctx.group, dim)
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
        return grad_q, reduce_scatter(grad_k, ctx.group, dim), reduce_scatter(grad_v, ctx.group, dim), None, None, None


class _Attention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :meth:`ContextParallel.attend`, and attention written
    by hand through :class:`~ndweave.dmodule.context.eager.HandWritten`."""

    def __init__(self, cp: ContextParallel, window: int | None, documents: torch.Tensor | None,
                 replace_model_mask: bool) -> None:
        super().__init__()
        self.cp, self.window, self.documents, self.replace = cp, window, documents, replace_model_mask
        self.hand_written = HandWritten(cp, window, documents, replace_model_mask)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is _SDPA:  # (a caller may have swapped F's for a while)
            return self.cp.attend(*args, **kwargs, window=self.window, documents=self.documents,
                                  replace_model_mask=self.replace)
        if func in _BACKWARDS:
            return self._backward(func, args, kwargs)
        if self.cp.size == 1:  # (one CP rank: its tokens are the sequence, attention written by hand as it is)
            return func(*args, **kwargs)
        if func in MATMULS and len(args) == 2 and not kwargs:
            out = self.hand_written.matmul(func, *args)
            if out is not None:
                return out
        elif func in MASKINGS:
            out = self.hand_written.masking(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)

    def _backward(self, func, args: tuple, kwargs: dict):
        """``func`` (a backward) with F's SDPA routed to :meth:`ContextParallel.attend`: backward runs with
        this mode off (a mode is off inside its own handler), and a checkpointed layer recomputed in it
        would otherwise attend to local tokens only. (Attention written by hand cannot be routed so: its
        recompute makes scores of another shape, which torch's checkpoint refuses.)"""
        torch_sdpa, inside = F.scaled_dot_product_attention, [False]
        if torch_sdpa is not _SDPA:  # (a caller swapped it already, and routes it to attend itself)
            return func(*args, **kwargs)

        def routed(*sdpa_args, **sdpa_kwargs):
            if inside[0]:  # (attend's own call: the kernel)
                return torch_sdpa(*sdpa_args, **sdpa_kwargs)
            inside[0] = True
            try:
                return self.cp.attend(*sdpa_args, **sdpa_kwargs, window=self.window, documents=self.documents,
                                      replace_model_mask=self.replace)
            finally:
                inside[0] = False

        F.scaled_dot_product_attention = routed
        try:
            return func(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = torch_sdpa
