"""MoE models for the expert-parallel tests, and the check every one of them runs on its ranks.

``check_expert_parallel(build, plan, dp, ep, tp)`` builds a model twice from one seed; one copy stays
on this process with plain torch (``AdamW``, ``clip_grad_norm_``), the other is parallelized over a
``("DP", "EP")`` mesh (``("DP", "EP", "TP")`` with ``tp > 1``) with ``plan``, wrapped in DDP and
stepped by an ndweave optimizer. Each DP x EP rank trains on its slice of the same global batch (its
TP ranks on the same slice). Every step compares the loss (the mean of the ranks'
losses), every gradient (before ZeRO), the clipped global grad norm and, after the step, every
parameter with the one-process copy, in float64 to the strict tolerance. It also counts the
all-to-alls of a step.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndweave.ddp import DDP
from ndweave.dmodule import parallelize_module
from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import STRICT, STRICT_DTYPE, Tolerance, assert_close, full_tensor
from ndweave.optim import BasicOptimizer, DistributedOptimizer

ROWS = 3  # rows (sequences or samples) per rank and step
#: For weights a model computes with in float32 whatever its dtype (DeepSeek-V3's router casts): their
#: grads are float32 sums over the tokens, which the ranks split; float32 rounding, with room for the
#: sums' length (tens of tokens), not float64's.
FLOAT32_SUMS = Tolerance(rtol=2.0 ** -17, atol=1e-9)


class Experts(nn.Module):
    """``num_experts`` two-layer experts stacked in 3-D weights, called as transformers' experts are:
    ``(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``."""

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, inner, hidden) / hidden ** 0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, inner) / inner ** 0.5)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            y = torch.tanh(x[token] @ self.w_in[e].T) @ self.w_out[e].T
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class TinyMoE(nn.Module):
    """in -> residual MoE block (softmax router, top-k renormalized) -> out."""

    def __init__(self, num_experts: int = 4, top_k: int = 2, width: int = 6) -> None:
        super().__init__()
        self.top_k = top_k
        self.inp = nn.Linear(5, width)
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = Experts(num_experts, width, 2 * width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        weights, index = torch.softmax(self.router(h), -1).topk(self.top_k, -1)
        h = h + self.experts(h, index, weights / weights.sum(-1, keepdim=True))
        return self.out(h)


class _Stack(nn.Module):
    """Experts stacked in 3-D, computed with gathered weights and ``bmm`` (not a loop over experts)."""

    def __init__(self, num_experts: int, width: int) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.randn(num_experts, 2 * width, width) / width ** 0.5)
        self.v = nn.Parameter(torch.randn(num_experts, width, 2 * width) / (2 * width) ** 0.5)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        flat = b.reshape(-1)
        rows = a.repeat_interleave(b.shape[1], dim=0)[:, None]          # (T k, 1, W)
        y = torch.bmm(torch.relu(torch.bmm(rows, self.u[flat].transpose(1, 2))), self.v[flat].transpose(1, 2))
        return (y.view(*b.shape, -1) * c[..., None]).sum(1)


class _Layer(nn.Module):
    def __init__(self, num_experts: int, top_k: int, width: int) -> None:
        super().__init__()
        self.k = top_k
        self.n = nn.LayerNorm(width)
        self.r = nn.Linear(width, num_experts, bias=False)
        self.q = _Stack(num_experts, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = self.n(h).reshape(-1, h.shape[-1])
        p, i = torch.softmax(self.r(flat), -1).topk(self.k, -1)
        return self.q(flat, i, p / p.sum(-1, keepdim=True)).view_as(h)


class Scrambled(nn.Module):
    """A MoE model of our own whose names mean nothing: ``a`` in, two residual layers ``b.<i>``
    (``n`` a norm, ``r`` the router, ``q`` the experts, stacked 3-D, run with ``bmm`` on gathered
    weights), ``z`` out; inputs (rows, 4, 5)."""

    def __init__(self, num_experts: int = 4, top_k: int = 2, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(5, width)
        self.b = nn.ModuleList(_Layer(num_experts, top_k, width) for _ in range(2))
        self.z = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        for layer in self.b:
            h = h + layer(h)
        return self.z(h)


class ListMoE(nn.Module):
    """A MoE block whose experts are a ``ModuleList`` of MLPs run by its own loop (the layout
    expert parallel does not take), after one of :class:`Experts` when ``stacked_too``."""

    def __init__(self, stacked_too: bool = False, num_experts: int = 4, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
                                     for _ in range(num_experts))
        self.stacked = Experts(num_experts, width, 2 * width) if stacked_too else None
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        weights, index = torch.softmax(self.router(h), -1).topk(2, -1)
        if self.stacked is not None:
            h = h + self.stacked(h, index, weights)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
        return self.out(h + out)


def scrambled_batch(step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, 4, 5, generator=g, dtype=STRICT_DTYPE),
            torch.randn(rows, 4, 3, generator=g, dtype=STRICT_DTYPE))


#: Tiny configs of transformers' MoE families (the zoo's plan names): 4 experts, top-2, 2 layers.
HF_MOE = {
    "hf_mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "hf_qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=16)),
    "hf_qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=8)),
    # layer 0 dense (first_k_dense_replace), layer 1 MoE with a shared expert; multi-head latent attention
    "hf_deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=4, moe_intermediate_size=8, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, num_key_value_heads=4)),
}
VOCAB = 64
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def build_hf_moe(family: str, **overrides) -> nn.Module:
    """A tiny transformers model of ``family`` (config fields ``overrides`` changed), eager experts and
    attention (float64 parity)."""
    import transformers

    config_name, model_name, extra = HF_MOE[family]
    sizes = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2)
    config = getattr(transformers, config_name)(**{**sizes, **extra, **overrides})
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    return getattr(transformers, model_name)(config)


def tiny_batch(step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 5, generator=g, dtype=STRICT_DTYPE), torch.randn(rows, 3, generator=g, dtype=STRICT_DTYPE)


def tiny_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def lm_batch(step: int, rows: int, seq: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    ids, targets = batch
    logits = model(input_ids=ids).logits  # the loss outside the model (HF's casts float64 logits down)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_loss_with_aux(model: nn.Module, batch) -> torch.Tensor:
    """The cross entropy plus ``router_aux_loss_coef`` times the load-balancing loss transformers
    computes in this forward (``output_router_logits=True``): its token statistics are this rank's."""
    ids, targets = batch
    out = model(input_ids=ids, output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    return ce + model.config.router_aux_loss_coef * out.aux_loss


def lm_loss_with_aux_per_rank(model: nn.Module, batch) -> torch.Tensor:
    """One process's :func:`lm_loss_with_aux` on the global batch, its load-balancing loss computed as
    the ranks compute it: transformers' own function on each rank's :data:`ROWS` rows, averaged over
    the ranks (the mean of the ranks' losses is what DDP's averaged grads descend)."""
    import sys

    ids, targets = batch
    out = model(input_ids=ids, output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    config, num_ranks = model.config, ids.shape[0] // ROWS
    per_rank = [tuple(layer.view(num_ranks, -1, layer.shape[-1])[r] for layer in out.router_logits)
                for r in range(num_ranks)]
    aux = torch.stack([balance(logits, logits[0].shape[-1], config.num_experts_per_tok) for logits in per_rank])
    return ce + config.router_aux_loss_coef * aux.mean()


def parallel_moe(model: nn.Module, plan: dict, *, dp: int, ep: int, tp: int = 1, zero: bool, clip: float = 0.0):
    """``model`` parallelized with ``plan`` over a ``("DP", "EP")`` mesh (``("DP", "EP", "TP")`` with
    ``tp > 1``), wrapped in DDP, and its ndweave AdamW (ZeRO with ``zero``; clipping to ``clip``)."""
    names = ("DP", "EP", "TP") if tp > 1 else ("DP", "EP")
    mesh = init_device_mesh("cpu", (dp, ep, tp)[:len(names)], mesh_dim_names=names)
    model = DDP(parallelize_module(model, mesh, plan), mesh, use_distributed_optimizer=zero, bucket_size=200)
    make = DistributedOptimizer if zero else BasicOptimizer
    return model, make(torch.optim.AdamW, [model], clip_grad=clip, optimizer_kwargs=ADAMW)


def check_expert_parallel(build: Callable[[], nn.Module], plan: dict, *, dp: int, ep: int, make_batch, loss_of,
                          zero: bool, steps: int, num_moe_layers: int, float32_params: tuple[str, ...] = (),
                          tp: int = 1, reference_loss_of=None, loss_tol: Tolerance = STRICT) -> None:
    """Run on every rank of a world of ``dp * ep * tp`` (see the module docstring). ``float32_params``:
    FQN substrings of weights the model computes with in float32, held to :data:`FLOAT32_SUMS`.
    ``reference_loss_of``: the one-process loss where it is not ``loss_of`` on the global batch;
    ``loss_tol``: the losses' tolerance."""
    torch.set_default_dtype(STRICT_DTYPE)  # both sides (the harness resets it after the test)
    torch.manual_seed(0)
    reference = build()
    model, optimizer = parallel_moe(copy.deepcopy(reference), plan, dp=dp, ep=ep, tp=tp, zero=zero)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    world, rank = dp * ep, dist.get_rank() // tp  # the data ranks; TP ranks (innermost) share a slice
    ref_params, params = dict(reference.named_parameters()), dict(model.named_parameters())
    assert list(params) == list(ref_params), "expert parallel changed the parameter names"
    for step in range(steps):
        batch = make_batch(step, world * ROWS)
        ref_optimizer.zero_grad()
        ref_loss = (reference_loss_of or loss_of)(reference, batch)
        ref_loss.backward()
        optimizer.zero_grad()
        with count_all_to_alls() as moves:
            loss = loss_of(model, tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in batch))
            loss.backward()
        # per MoE layer: forward, the counts' exchange and the rows there and back; backward, the two
        # moves of rows reversed. None with EP 1
        expected = 5 * num_moe_layers if ep > 1 else 0
        assert len(moves) == expected, f"step {step}: {len(moves)} all-to-alls, expected {expected}"
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total / (world * tp), ref_loss, name=f"step {step} loss", tol=loss_tol)
        if not zero:  # BasicOptimizer: every .grad is the whole reduced grad
            model.finish_grad_sync()
            for fqn, ref_p in ref_params.items():
                assert_close(full_tensor(params[fqn].grad), ref_p.grad, name=f"step {step} {fqn}.grad",
                             tol=_tolerance(fqn, float32_params))
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        norm = optimizer.clip_grad_norm(0.5)
        assert_close(norm, ref_norm.to(norm.dtype), name=f"step {step} global grad norm",
                     tol=FLOAT32_SUMS if float32_params else STRICT)
        ref_optimizer.step()
        optimizer.step()
        for fqn, ref_p in ref_params.items():
            assert_close(full_tensor(params[fqn]), ref_p, name=f"step {step} {fqn} after the step",
                         tol=_tolerance(fqn, float32_params))
    experts = [p for p in params.values() if isinstance(p, DTensor) and "EP" in p.device_mesh.mesh_dim_names]
    assert len(experts) >= 2 * num_moe_layers and all(p.to_local().shape[0] * ep == p.shape[0] for p in experts)
    tensor_parallel = [fqn for fqn, p in params.items() if isinstance(p, DTensor) and
                       p.device_mesh.mesh_dim_names == ("TP",) and any(pl.is_shard() for pl in p.placements)]
    assert bool(tensor_parallel) == (tp > 1), f"params sharded over TP: {tensor_parallel}"


def _tolerance(fqn: str, float32_params: tuple[str, ...]) -> Tolerance:
    return FLOAT32_SUMS if any(part in fqn for part in float32_params) else STRICT


@contextlib.contextmanager
def count_all_to_alls(off_rank: list[int] | None = None) -> Iterator[list[int]]:
    """The bytes each ``all_to_all_single`` call sends, in call order; ``off_rank`` (if given) gets
    the bytes of each that leave this rank (its own split excluded). (torch's ``CommDebugMode``
    would count them, but its module tracker trips over transformers' models here.)"""
    calls: list[int] = []
    real = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        calls.append(input.numel() * input.element_size())
        if off_rank is not None:
            own = input_split_sizes[dist.get_rank(group)] if input_split_sizes else input.shape[0] // \
                dist.get_world_size(group)
            off_rank.append(calls[-1] - own * input.shape[1:].numel() * input.element_size())
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    with mock.patch.object(dist, "all_to_all_single", counted):
        yield calls
