"""explain_plan: each entry's pattern, what stays replicated and why, bytes per rank."""

import pytest
from dmodule_auto_models import Obfuscated, build_hf
from dmodule_zoo_models import build
from torch.distributed.tensor import Replicate

from ndweave.dmodule import explain_plan, get_plan


def test_explains_every_entry_of_the_auto_plan_and_counts_bytes():
    model = Obfuscated()
    text = explain_plan(model, tp_size=4)
    assert text.startswith("automatic plan for Obfuscated on 4 tensor-parallel ranks")
    assert "parameter['blk.\\\\d+.b.a.weight'] = [_StridedShard(dim=0, sf=3)]  (2 modules)" in text
    assert "why: column-wise: fused output cut into 3 equal pieces" in text
    assert "why: row-wise: takes the features the columns of blk.N.b split" in text
    assert "bytes per rank: 24.0 KiB of 96.0 KiB" in text  # two (192, 64) float32 q|k|v weights, a quarter each
    assert "replicated: nothing the planner could shard" in text
    assert "not from auto" not in text
    # the five norm weights (64 each) stay whole on every rank; everything else is cut in four
    total = sum(p.numel() for p in model.parameters()) * 4
    norms = 5 * 64 * 4
    assert f"parameters per rank: {(total - norms) / 4 / 1024 + norms / 1024:.1f} KiB of {total / 1024:.1f} KiB" in text


def test_a_zoo_plan_is_explained_by_the_patterns_auto_finds():
    pytest.importorskip("transformers")
    model = build("hf_llama")
    text = explain_plan(model, get_plan("hf_llama", model, sequence_parallel=True))
    assert "sequence_parallel=True" in text and "not from auto" not in text
    assert "why: all-gathered on the sequence before the column-wise linears (SP)" in text


def test_hand_edits_and_stale_keys_are_called_out():
    model = Obfuscated()
    plan = get_plan("auto", model)
    plan["parameter"][r"blk.\d+.d.d.weight"] = [Replicate()]
    plan["forward"]["nothing.here.output"] = [[Replicate()]]
    text = explain_plan(model, plan)
    assert "not from auto (auto writes [Shard(dim=1)] for blk.N.d.d.weight: row-wise" in text
    assert "why: matches no module of this model" in text


def test_replicated_blocks_are_listed_with_why():
    pytest.importorskip("transformers")
    text = explain_plan(build_hf("phi3", num_key_value_heads=2))
    assert "model.layers.0.self_attn.qkv_proj.weight: replicated (the fused output" in text
    assert "unequal pieces [64, 32, 32]" in text
    assert "model.layers.0.self_attn.o_proj.weight: replicated (takes the output of" in text
    assert "patch['model.layers.\\\\d+.self_attn'] = ['replicated_local']" in text
