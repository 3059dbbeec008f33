"""get_plan("auto", model) on transformers' decoders it was never written for: TP and TP+SP on 2
ranks equal one process in float64 (logits, loss, every gradient, parameters after SGD steps)."""

import pytest

pytest.importorskip("transformers")

from dmodule_auto_models import FLOAT32_INSIDE, check_auto_parity  # noqa: E402

from ndweave.mesh.testing import distributed  # noqa: E402

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
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@distributed(world_size=2, timeout=180)
def test_moe_experts_are_sharded_inside_each_expert(arch, sequence_parallel):
    """3-D expert weights: each expert's gate|up and down projections split over the ranks, the
    experts module run whole on its shards (local_block), the router replicated. (transformers routes
    in float32: see FLOAT32_INSIDE.)"""
    check_auto_parity(arch, sequence_parallel=sequence_parallel, tol=FLOAT32_INSIDE)
