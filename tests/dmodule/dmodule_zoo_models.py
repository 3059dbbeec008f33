"""The plan zoo's test models and the parity check every zoo test runs on its ranks.

``check_parity(name, ...)`` builds a tiny model of family ``name`` twice from one seed, parallelizes
one copy with ``get_plan(name, model)`` and nothing else, then for a few optimizer steps compares the
output logits, the loss, every parameter's gradient and (after the step) every parameter with the
single-device copy. Both sides run in float64 and are held to the strict tolerance
(``ndweave.mesh.testing.STRICT``), so the check does not depend on this machine's kernels.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from core_models import MLP  # the seed's MLP (4 -> 8 -> 4)
from gpt_model import GPT, GPTConfig  # the job's GPT, copied into the tests (tests/gpt_model.py)
from ndweave.mesh.testing import STRICT_DTYPE, assert_close

BATCH, SEQ = 2, 16
_NORM = re.compile(r"(norm|ln_\w+|layernorm)\.(weight|bias)$")


def build(name: str, **overrides) -> nn.Module:
    """A tiny model of family ``name`` (in the default dtype, dropout 0); ``overrides`` go to its config."""
    if name == "mlp":
        return MLP()
    if name == "nanogpt":
        cfg = dict(vocab_size=100, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
        return GPT(GPTConfig(**{**cfg, **overrides}))
    if name == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                   attention_dropout=0.0, attn_implementation="sdpa")
        return LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides}))
    if name == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = dict(vocab_size=50257, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        return GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides}))
    raise KeyError(name)


def batch(name: str, model: nn.Module, step: int):
    """The same inputs on every rank: (input ids or activations, targets)."""
    g = torch.Generator().manual_seed(1000 + step)
    if name == "mlp":
        return torch.randn(BATCH, SEQ, 4, generator=g), None
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def run(name: str, model: nn.Module, inputs, targets, step: int = 0):
    """(logits or output, loss): one training forward, whatever the family's calling convention."""
    if name == "mlp":
        out = model(inputs)
        return out, out.sum()
    if name == "nanogpt":
        return model(inputs, targets)
    kwargs = {}
    # odd steps: left padding on the second sequence, through HF's own mask building. Not with Llama's
    # eager attention: in float64 its softmax (taken in fp32) turns fully masked rows into NaN, on one
    # process too
    if step % 2 and not (name == "hf_llama" and model.config._attn_implementation == "eager"):
        mask = torch.ones_like(inputs)
        mask[1, :3] = 0
        kwargs["attention_mask"] = mask
    logits = model(input_ids=inputs, **kwargs).logits
    # the loss outside the model, as users write it (HF's own casts float64 logits down to fp32)
    return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def expected_collectives(name: str, model: nn.Module, sequence_parallel: bool) -> tuple[dict, dict]:
    """Collectives of one forward and one backward under Megatron's layout (what the plans aim at).

    Tensor parallel: one all-reduce per row-wise projection forward, one per column-wise group
    backward (plus the embedding's in forward, lm_head's input in backward), and the logits'
    all-gather. Sequence parallel turns each all-reduce into an all-gather + reduce-scatter pair.
    """
    if name == "mlp":  # (its loss, out.sum(), sends back an all-ones gradient: already replicated)
        return ({"reduce_scatter_tensor" if sequence_parallel else "all_reduce": 1}, {})
    config = model.config
    layers = getattr(config, "n_layer", None) or config.num_hidden_layers
    learned_positions = name != "hf_llama"  # wpe's output is sliced to the sequence shard: its grad gathered
    if not sequence_parallel:
        return ({"all_reduce": 2 * layers + 1, "all_gather_into_tensor": 1}, {"all_reduce": 2 * layers + 1})
    return (
        {"reduce_scatter_tensor": 2 * layers + 1, "all_gather_into_tensor": 2 * layers + 2},
        {"reduce_scatter_tensor": 2 * layers + 1, "all_gather_into_tensor": 2 * layers + 1 + learned_positions},
    )


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}


def _aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name -> the name ``named_parameters()`` reports for it (tied names differ)."""
    first: dict[int, str] = {}
    return {alias: first.setdefault(id(p), alias) for alias, p in model.named_parameters(remove_duplicate=False)}


def check_parity(name: str, *, sequence_parallel: bool = False, steps: int = 2, optimizer: str = "sgd",
                 plan: str | None = None, **overrides) -> None:
    """Run on every rank: ``get_plan(name, model)`` (or ``get_plan(plan, model)``: ``"auto"``) on a 1-D
    TP mesh matches one device, step by step."""
    from ndweave.dmodule import DModule, parallelize_module
    from ndweave.dmodule.plans import get_plan

    torch.set_default_dtype(STRICT_DTYPE)  # both sides (the harness resets it after the test)
    torch.manual_seed(0)
    reference = build(name, **overrides)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("TP",))
    model = parallelize_module(model, mesh, get_plan(plan or name, model, sequence_parallel=sequence_parallel))
    assert isinstance(model, DModule)

    def make_optimizer(params):
        if optimizer == "adam":
            # eps well above rounding noise: a gradient that is zero in exact arithmetic (a key bias
            # under softmax) is pure noise that Adam would otherwise blow up to a full step
            return torch.optim.Adam(params, lr=1e-2, eps=1e-4, foreach=False)
        return torch.optim.SGD(params, lr=0.5, momentum=0.9, foreach=False)

    ref_params = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    assert list(params) == list(ref_params), "parallelize_module changed the parameter names (or untied a weight)"
    for alias, canonical in _aliases(reference).items():  # tied weights stay one parameter
        assert model.get_parameter(alias) is params[canonical], f"{alias} is no longer tied to {canonical}"
    ref_opt, opt = make_optimizer(reference.parameters()), make_optimizer(model.parameters())
    for step in range(steps):
        inputs, targets = batch(name, reference, step)
        ref_out, ref_loss = run(name, reference, inputs, targets, step)
        with CommDebugMode() as forward_comms:
            out, loss = run(name, model, inputs, targets, step)
        assert_close(out, ref_out, name=f"step {step} output")
        assert_close(loss, ref_loss, name=f"step {step} loss")
        ref_loss.backward()
        with CommDebugMode() as backward_comms:
            loss.backward()
        expected = expected_collectives(name, reference, sequence_parallel)
        actual = (_counts(forward_comms), _counts(backward_comms))
        if step == 0:  # the first call's check that every rank's plain inputs have one shape (once only)
            assert actual[0].pop("allgather_", 0) > 0, "the first forward did not check plain input shapes"
        assert actual == expected, f"step {step}: collectives (forward, backward) {actual}, Megatron's {expected}"
        pending = {e.fqn for e in model.list_grad_sync() if e.status == "pending"}
        # only replicated norm weights may wait for finish_grad_sync: a Partial gradient anywhere else
        # is a full-size gradient the plan failed to keep sharded
        assert all(_NORM.search(fqn) for fqn in pending), f"unexpected Partial gradients: {sorted(pending)}"
        if sequence_parallel and name != "mlp":
            assert pending, "sequence parallel, yet no norm weight has a Partial gradient: is the stream sharded?"
        if not sequence_parallel:  # tensor parallel reduces activation gradients where Megatron does
            assert not pending, f"tensor parallel left Partial gradients: {sorted(pending)}"
        model.finish_grad_sync()
        for fqn, ref_p in ref_params.items():
            assert params[fqn].grad is not None, f"step {step}: {fqn} got no gradient"
            assert_close(params[fqn].grad, ref_p.grad, name=f"step {step} {fqn}.grad")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    for fqn, ref_p in ref_params.items():
        assert_close(params[fqn], ref_p, name=f"{fqn} after {steps} steps")


def check_deferred(name: str, plan: str | None = None, **overrides) -> None:
    """Run on every rank: a ``deferred_init`` model parallelized with its zoo plan (patches included)
    holds exactly the eager model's values and computes the same loss."""
    from ndweave.dmodule import deferred_init, parallelize_module
    from ndweave.dmodule.plans import get_plan

    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    eager = build(name, **overrides)
    torch.manual_seed(0)
    model = deferred_init(build, name, **overrides)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("TP",))
    model = parallelize_module(model, mesh, get_plan(plan or name, eager))
    for (fqn, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
        assert torch.equal(q.full_tensor(), p), f"{fqn} differs from eager init"
    inputs, targets = batch(name, eager, 0)
    assert_close(run(name, model, inputs, targets)[1], run(name, eager, inputs, targets)[1], name="loss")
