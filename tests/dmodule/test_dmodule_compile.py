"""DModule compiled per block, as users compile (issue #41): ``block.compile()`` on each transformer
block of a model ``parallelize_module`` returned, the zoo's plans and "auto", TP and TP+SP, inductor
(C++ on this CPU, float64 kept), against the same model on one process, eager: the loss, every
gradient and the parameters after each of three Adam steps: the GPT to the strict float64 tolerance;
transformers' models, whose norms compute in float32 whatever the dtype, to ``FLOAT32_INSIDE`` (inductor
fuses those float32 parts otherwise than eager does: ~1e-7 apart).

``model.compile()`` on the whole model trains alike too, and its graph breaks are listed (none for the
GPT and auto's Llama at TP+SP).

And the graphs, counted with dynamo's counters (``ndweave.mesh.torch_compat.compile_counts``): the first
call runs eagerly (DModule's first-call checks, and the auto plan finding out whether its model needs
plain tensors converted: most do not, and then run without it), the second compiles one graph that
every block runs (the first may compile apart; none of the others again: a block's hooks read
nothing that differs between blocks), no graph break, and the third compiles nothing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dmodule_auto_models import FLOAT32_INSIDE
from dmodule_zoo_models import batch, build, run
from torch.distributed.device_mesh import init_device_mesh

from ndweave.mesh.testing import STRICT, STRICT_DTYPE, assert_close, distributed, run_distributed
from ndweave.mesh.torch_compat import compile_counts, reset_compile_counts

pytest.importorskip("transformers")

#: (model, plan, sequence parallel): CI runs these; the rest of CASES under -m slow (each compiles its
#: blocks with inductor: 10-30 s on 2 cores)
SAMPLE = [("nanogpt", "nanogpt", True), ("hf_llama", "auto", True)]
CASES = [*SAMPLE, ("nanogpt", "nanogpt", False), ("hf_llama", "hf_llama", False), ("hf_llama", "hf_llama", True),
         ("hf_gpt2", "hf_gpt2", True), ("hf_llama", "auto", False)]
AUTO_FAMILIES = ["qwen2", "mistral", "phi3"]
#: each zoo family's number of blocks: the GPT ten (beyond torch's recompile limit of 8); transformers'
#: three (their float32 norms drift further from eager under inductor with depth; three blocks compiled
#: apart would show as three graphs)
DEPTH = {"nanogpt": {"n_layer": 10}, "hf_llama": {"num_hidden_layers": 3}, "hf_gpt2": {"n_layer": 3}}


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the model's first ModuleList (``model.layers``, ``transformer.h``)."""
    return list(next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList)))


def _check_compiled(reference: torch.nn.Module, name: str, plan: str, sequence_parallel: bool, steps: int = 3,
                    whole: bool = False) -> list[dict[str, int]]:
    """Train ``reference`` on one process and parallelized and compiled (each block, or ``whole``: the
    model) on every rank, comparing as they go; each step's graph breaks (``whole``: allowed)."""
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    if hasattr(reference, "config"):  # training: no KV cache (its per-layer state would make each block compile again)
        reference.config.use_cache = False
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("TP",))
    model = parallelize_module(model, mesh, get_plan(plan, model, sequence_parallel=sequence_parallel))
    blocks = [model] if whole else _blocks(model)
    torch.compiler.reset()  # (a pooled rank may have compiled these classes' code for an earlier test)
    tol = STRICT if name == "nanogpt" else FLOAT32_INSIDE
    for block in blocks:
        block.compile()
    breaks = []
    ref_params, params = dict(reference.named_parameters()), dict(model.named_parameters())
    assert list(params) == list(ref_params), "compiling changed the parameter names (an _orig_mod. prefix?)"
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, eps=1e-4, foreach=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4, foreach=False)
    for step in range(steps):
        inputs, targets = batch(name, reference, step)
        ref_out, ref_loss = run(name, reference, inputs, targets)
        reset_compile_counts()
        out, loss = run(name, model, inputs, targets)
        ref_loss.backward()
        loss.backward()
        counts = compile_counts()
        breaks.append(counts.graph_breaks)
        # step 0 runs eagerly; step 1 compiles each block into one graph; later steps compile nothing
        assert (counts.frames > 0) == (step == 1), f"step {step}: {counts}"
        if not whole:
            assert not counts.graph_breaks, f"step {step}: graph breaks {counts.graph_breaks}"
            # one graph serves every block: nothing per block (an FQN read in a hook) is guarded, else
            # each compiles again and past torch's recompile limit (8) blocks run eagerly. (The first block
            # may compile apart: its input comes from outside the blocks, on an equal mesh object or not.)
            assert counts.graphs <= (2 if step == 1 else 0), f"step {step}: {counts}"
        assert_close(out, ref_out, name=f"step {step} output", tol=tol)
        assert_close(loss, ref_loss, name=f"step {step} loss", tol=tol)
        model.finish_grad_sync()
        for fqn, ref_p in ref_params.items():
            assert_close(params[fqn].grad, ref_p.grad, name=f"step {step} {fqn}.grad", tol=tol)
        for optimizer in (ref_opt, opt):
            optimizer.step()
            optimizer.zero_grad()
        for fqn, ref_p in ref_params.items():
            assert_close(params[fqn], ref_p, name=f"{fqn} after step {step}", tol=tol)
    return breaks


@distributed(world_size=2, timeout=600)
def _zoo_case(name: str, plan: str, sequence_parallel: bool) -> None:
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    _check_compiled(build(name, **DEPTH[name]), name, plan, sequence_parallel)


@pytest.mark.parity
@pytest.mark.parametrize("name, plan, sequence_parallel",
                         [pytest.param(*case, marks=[] if case in SAMPLE else [pytest.mark.slow]) for case in CASES])
def test_blocks_compiled_train_like_one_process_with_one_graph_each(name, plan, sequence_parallel):
    _zoo_case(name, plan, sequence_parallel)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("family", AUTO_FAMILIES)
@pytest.mark.parametrize("sequence_parallel", [False, True])
@distributed(world_size=2, timeout=600)
def test_auto_plans_compiled_train_like_one_process(family, sequence_parallel):
    from dmodule_auto_models import build_hf

    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference = build_hf(family)
    reference.config.vocab_size = reference.get_output_embeddings().weight.shape[0]
    _check_compiled(reference, "hf_llama", "auto", sequence_parallel)  # (an HF causal LM: hf_llama's batch and run)


@pytest.mark.parametrize("where", ["model", "block"])
def test_compiling_before_parallelize_module_is_refused_naming_the_fix(where):
    """``torch.compile(m)`` wraps ``m`` (its FQNs gain ``_orig_mod.``, which no plan names): refused
    before any tensor moves, naming the compiled module and ``block.compile()`` after the plan."""
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    model = build("nanogpt")
    plan = get_plan("nanogpt", model)
    if where == "model":
        model, named = torch.compile(model), "<the module itself>"
    else:
        model.transformer.h[1], named = torch.compile(model.transformer.h[1]), "transformer.h.1"
    with pytest.raises(TypeError, match=rf"{named} is torch.compile'd .*parallelize first, then .*block.compile\(\)"):
        parallelize_module(model, None, plan)


@pytest.mark.parity
@pytest.mark.parametrize("name, plan", [("nanogpt", "nanogpt"), pytest.param("hf_llama", "auto", marks=pytest.mark.slow)])
def test_the_whole_model_compiled_trains_like_one_process_and_lists_its_breaks(name, plan):
    """``model.compile()`` on the whole parallelized model (not per block): it trains like one process;
    where dynamo breaks the graph (DModule's hooks, DTensor redistributions between blocks) is listed."""
    breaks = run_distributed(_whole, 2, name, plan, timeout=600)[0]
    print(f"{name} ({plan}): graph breaks at step 1: {breaks[1] or 'none'}")
    assert not any(breaks[2:]), breaks  # and nothing is compiled again


def _whole(name: str, plan: str) -> list[dict[str, int]]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(STRICT_DTYPE)
    try:
        torch.manual_seed(0)
        return _check_compiled(build(name), name, plan, sequence_parallel=True, whole=True)
    finally:
        torch.set_default_dtype(previous)
