"""get_plan("auto", model) on transformers' decoders it was never written for: TP and TP+SP on 2
ranks equal one process in float64 (logits, loss, every gradient, parameters after SGD steps)."""

import pytest

pytest.importorskip("transformers")

from dmodule_auto_models import check_auto_parity  # noqa: E402

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
    ("mixtral", dict()),                            # experts inside one module: the MoE block replicated
], ids=["phi3_gqa", "falcon_mqa", "mixtral"])
@distributed(world_size=2, timeout=180)
def test_what_cannot_be_sharded_runs_replicated(arch, overrides):
    check_auto_parity(arch, sequence_parallel=True, **overrides)
