"""get_plan("auto", model) on transformers' decoders it was never written for: TP and TP+SP on 2
ranks equal one process in float64 (logits, loss, every gradient, parameters after SGD steps)."""

import pytest

pytest.importorskip("transformers")

from dmodule_auto_models import FLOAT32_INSIDE, FLOAT32_ROUTING, build_hf, check_auto_parity  # noqa: E402

from ndweave.mesh.testing import STRICT, distributed  # noqa: E402

MODES = pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])


@pytest.mark.parity
@MODES
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "phi3", "gpt_neox"])
@distributed(world_size=2, timeout=180)
def test_auto_plan_matches_one_process(arch, sequence_parallel):
    check_auto_parity(arch, sequence_parallel=sequence_parallel)


@pytest.mark.parity
@pytest.mark.parametrize("arch,overrides", [
    ("phi3", dict(num_key_value_heads=2)),          # fused q|k|v of unequal pieces: attention replicated
    ("falcon", dict()),                             # multi-query attention: one key/value head
], ids=["phi3_gqa", "falcon_mqa"])
@distributed(world_size=2, timeout=180)
def test_what_cannot_be_sharded_runs_replicated(arch, overrides):
    check_auto_parity(arch, sequence_parallel=True, **overrides)


@pytest.mark.parity
@MODES
@distributed(world_size=2, timeout=180)
def test_tied_head_with_activation_checkpointing_matches_one_process(sequence_parallel):
    """Qwen2 with its LM head tied to the embedding (as its small models are) and transformers'
    activation checkpointing enabled before the plan is derived, as the GPT job does: the embedding
    stays vocab-parallel, one Shard(0) tensor with the column-wise head, and trains as one process
    without checkpointing."""
    check_auto_parity("qwen2", sequence_parallel=sequence_parallel, activation_checkpointing=True,
                      tie_word_embeddings=True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2"])
def test_activation_checkpointing_does_not_change_the_plan(arch, tied):
    """transformers' activation checkpointing puts a forward hook on the input embeddings that calls
    ``output.requires_grad_(True)``: it sets a flag and carries no data, so the plan is the one
    without checkpointing (the embedding vocab-parallel, not replicated)."""
    from ndweave.dmodule.plans import get_plan

    model = build_hf(arch, tie_word_embeddings=tied)
    without = [get_plan("auto", model, sequence_parallel=sp) for sp in (False, True)]
    model.activation_checkpointing_enable()
    assert [get_plan("auto", model, sequence_parallel=sp) for sp in (False, True)] == without


@pytest.mark.kernels
@pytest.mark.parity
@MODES
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@distributed(world_size=2, timeout=180)
def test_moe_experts_are_sharded_inside_each_expert(arch, sequence_parallel):
    """3-D expert weights: each expert's gate|up and down projections split over the ranks, the
    experts module run whole on its shards (local_block), the router replicated. (transformers routes
    in float32: see FLOAT32_INSIDE.)"""
    check_auto_parity(arch, sequence_parallel=sequence_parallel, tol=FLOAT32_INSIDE)


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3", "gpt_neox", "falcon", "opt", "gpt2",
                                  *sorted(FLOAT32_ROUTING)])
@distributed(world_size=4, timeout=300)
def test_auto_plan_at_tp4_matches_one_process(arch):
    """TP=4 with sequence parallel: one query head and one key/value head per rank (the tiny config's
    4 of each; Falcon's single key/value head keeps its attention replicated)."""
    tol = FLOAT32_INSIDE if arch in FLOAT32_ROUTING else STRICT
    check_auto_parity(arch, sequence_parallel=True, tol=tol, num_key_value_heads=4)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_deriving_the_plan_of_a_7b_llama_on_meta_takes_under_5_s(sequence_parallel):
    """Planning a model too large for one process, before materializing it: a 32-layer Llama-2-7B
    on the meta device (measured ~0.6 s of CPU time; CPU time, so other load on the machine does
    not count)."""
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ndweave.dmodule.plans import get_plan

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
                                             num_attention_heads=32, num_key_value_heads=32, vocab_size=32000))
    start = time.process_time()
    plan = get_plan("auto", model, sequence_parallel=sequence_parallel)
    seconds = time.process_time() - start
    assert seconds < 5, f"deriving the plan took {seconds:.1f} s of CPU time"
    assert plan["parameter"], "nothing was sharded"


def test_a_pad_token_in_the_config_does_not_change_the_plan():
    """GPT-2 with a pad token checks ``pad_token_id in input_ids`` (a data-dependent read) in its
    forward: on the meta trace it is taken as absent, and the plan is the one without the token."""
    from ndweave.dmodule.plans import get_plan

    assert get_plan("auto", build_hf("gpt2", pad_token_id=0)) == get_plan("auto", build_hf("gpt2"))
