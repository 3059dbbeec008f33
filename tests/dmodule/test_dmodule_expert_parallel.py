"""Expert parallel in dmodule: ``get_plan("hf_mixtral", model, expert_parallel=True)`` on a mesh with an
"EP" dim and no "TP" dim divides transformers' stacked experts over it (``Shard(0)`` DTensors keeping
their FQNs and global shapes) while every other tensor stays a plain tensor (the plan's tensor-parallel
entries change nothing over one TP rank), and each rank's tokens reach their
experts and come back: outputs and gradients equal one process's, in float64. And the errors."""

from __future__ import annotations

import copy
import weakref

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from ndweave.dmodule import get_plan, parallelize_module  # noqa: E402
from ndweave.mesh import init_device_mesh  # noqa: E402
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed  # noqa: E402

_ROWS, _SEQ = 3, 8


def _mixtral(**overrides):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**{**dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                     num_local_experts=4, num_experts_per_tok=2), **overrides})
    config._experts_implementation = "eager"  # float64 parity: the eager loops, as one process runs them
    config._attn_implementation = "eager"
    return MixtralForCausalLM(config)


@pytest.mark.parity
@distributed(world_size=2)
def test_mixtral_experts_over_ep_match_one_process():
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference = _mixtral()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("EP",))
    model = parallelize_module(copy.deepcopy(reference), mesh, get_plan("hf_mixtral", reference, expert_parallel=True))
    rank = dist.get_rank()

    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, DTensor) and experts.gate_up_proj.placements == (Shard(0),)
    assert experts.gate_up_proj.shape == (4, 64, 16) and experts.gate_up_proj.to_local().shape == (2, 64, 16)
    assert not isinstance(model.model.layers[0].mlp.gate.weight, DTensor)  # the router: plain, whole
    state = model.state_dict()
    assert list(state) == list(reference.state_dict())  # FQNs unchanged; experts as their global tensors
    assert torch.equal(state["model.layers.1.mlp.experts.down_proj"].full_tensor(),
                       reference.model.layers[1].mlp.experts.down_proj)

    ids = torch.randint(0, 64, (2 * _ROWS, _SEQ), generator=torch.Generator().manual_seed(1))
    ref_logits = reference(input_ids=ids).logits
    F.cross_entropy(ref_logits.flatten(0, 1), ids.flatten(), reduction="sum").backward()
    mine = slice(rank * _ROWS, (rank + 1) * _ROWS)
    logits = model(input_ids=ids[mine]).logits
    F.cross_entropy(logits.flatten(0, 1), ids[mine].flatten(), reduction="sum").backward()

    assert_close(logits, ref_logits[mine], name="logits of this rank's rows")
    for fqn, ref_p in reference.named_parameters():
        grad = model.get_parameter(fqn).grad
        if isinstance(grad, DTensor):  # an expert's grad sums every rank's tokens: whole on its rank
            assert_close(grad.to_local(), ref_p.grad[2 * rank:2 * rank + 2], name=f"{fqn}.grad (this rank's experts)")
        else:  # a dense grad holds this rank's tokens' share: the ranks' shares sum to one process's
            dist.all_reduce(grad)
            assert_close(grad, ref_p.grad, name=f"{fqn}.grad summed over the ranks")


@pytest.mark.parity
@distributed(world_size=2, timeout=300)
def test_compiled_mixtral_layers_over_ep_break_only_at_the_dispatch_and_match_one_process():
    """Each decoder layer compiled (inductor) after the plan: the experts' token dispatch stays out of the
    graph (its all-to-all's splits are the routing's values), the only graph break, giving that reason;
    one function routes every layer's experts, so nothing compiles again after the step that compiled; the logits and grads equal one
    process's each step (to FLOAT32_INSIDE: inductor fuses the norms transformers runs in float32
    otherwise than eager, ~1e-8 apart). ``fullgraph=True`` raises, naming the reason."""
    from dmodule_auto_models import FLOAT32_INSIDE

    from ndweave.dmodule.experts.parallel import DISPATCH_BREAK
    from ndweave.mesh.torch_compat import compile_counts, reset_compile_counts

    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference = _mixtral()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("EP",))
    model = parallelize_module(copy.deepcopy(reference), mesh, get_plan("hf_mixtral", reference, expert_parallel=True))
    torch.compiler.reset()  # (a pooled rank may have compiled this code for an earlier test)
    for layer in model.model.layers:
        layer.compile()
    rank = dist.get_rank()
    mine = slice(rank * _ROWS, (rank + 1) * _ROWS)
    for step in range(3):
        ids = torch.randint(0, 64, (2 * _ROWS, _SEQ), generator=torch.Generator().manual_seed(step))
        for model_ in (reference, model):
            model_.zero_grad()
        ref_logits = reference(input_ids=ids).logits
        F.cross_entropy(ref_logits.flatten(0, 1), ids.flatten(), reduction="sum").backward()
        reset_compile_counts()
        logits = model(input_ids=ids[mine]).logits
        F.cross_entropy(logits.flatten(0, 1), ids[mine].flatten(), reduction="sum").backward()
        counts = compile_counts()
        assert_close(logits, ref_logits[mine], name=f"step {step} logits of this rank's rows", tol=FLOAT32_INSIDE)
        expert = model.model.layers[0].mlp.experts.gate_up_proj.grad.to_local()
        assert_close(expert, reference.model.layers[0].mlp.experts.gate_up_proj.grad[2 * rank:2 * rank + 2],
                     name=f"step {step} experts' grad", tol=FLOAT32_INSIDE)
        dense = model.model.layers[1].self_attn.q_proj.weight.grad.clone()
        dist.all_reduce(dense)
        assert_close(dense, reference.model.layers[1].self_attn.q_proj.weight.grad, name=f"step {step} q_proj grad", tol=FLOAT32_INSIDE)
        if step == 0:  # (the first call runs eagerly: DModule's checks)
            continue
        assert (counts.frames > 0) == (step == 1), f"step {step}: {counts}"
        # (dynamo counts the break once per frame it passes through: the layer's, the MoE block's)
        assert set(counts.break_reasons()) == ({DISPATCH_BREAK} if step == 1 else set()), counts.break_reasons()
    strict = torch.compile(model.model.layers[1].mlp, fullgraph=True)  # (the MoE block: not compiled above)
    with pytest.raises(Exception, match="token all-to-all"):
        strict(torch.randn(_ROWS, _SEQ, 16))


@distributed(world_size=2)
def test_each_rank_keeps_only_its_own_experts():
    """Once divided, the whole weights are freed: each rank holds E/EP experts, not E."""
    from ndweave.dmodule.experts.parallel import parallelize_experts

    experts = _mixtral().model.layers[0].mlp.experts
    whole = [weakref.ref(p) for p in experts.parameters()]
    parallelize_experts(experts, init_device_mesh("cpu", (2,), mesh_dim_names=("EP",)))
    assert [ref() for ref in whole] == [None, None]


@distributed(world_size=2)
def test_experts_that_do_not_divide_over_ep_are_refused():
    model = _mixtral(num_local_experts=3)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("EP",))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts': 3 experts do not divide over 2 EP ranks"):
        parallelize_module(model, mesh, get_plan("hf_mixtral", model, expert_parallel=True))


@distributed(world_size=4)
def test_an_ep_dim_with_a_plan_that_places_no_experts_is_refused():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "EP"))
    with pytest.raises(ValueError, match=r"'EP' dim of 2 ranks, but the plan divides no experts over it.*make those "
                                         r"ranks data parallel"):
        parallelize_module(torch.nn.Linear(4, 4), mesh, {})


@distributed(world_size=2)
def test_the_expert_patch_needs_an_ep_dim():
    model = _mixtral()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    with pytest.raises(ValueError, match=r"the mesh has dims \['TP'\] and no 'EP' dim"):
        parallelize_module(model, mesh, {"patch": {r"model.layers.\d+.mlp.experts": ["expert_parallel"]}})


def test_zoo_refuses_experts_where_there_are_none_and_top_k_beyond_the_experts():
    with pytest.raises(ValueError, match=r"'hf_llama' models have no experts.*'hf_mixtral'"):
        get_plan("hf_llama", None, expert_parallel=True)
    with pytest.raises(ValueError, match=r"top-k num_experts_per_tok=5 is more than the 4 experts"):
        get_plan("hf_mixtral", _mixtral(num_experts_per_tok=5), expert_parallel=True)
    with pytest.raises(ValueError, match=r"divides the experts over EP \(expert_parallel=True"):
        get_plan("hf_mixtral", _mixtral())
