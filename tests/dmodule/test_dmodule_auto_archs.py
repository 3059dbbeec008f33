"""Every decoder transformers ships, through get_plan("auto") (heavy: tens of seconds each).

``test_every_decoder`` is parametrized over transformers' causal LM registry: a model type that does
not build and run on one process from the tiny config (2 layers, hidden 64, 4 heads; encoder-decoder
and multimodal ones, configs whose other sizes do not fit) is skipped with the reason; every other
one must match one process under TP+SP on 2 ranks. Whatever "auto" cannot shard runs replicated,
so this counts models that train correctly, not models fully sharded; ``explain_plan`` says which
parts stay replicated. Run it with ``-m heavy -k every_decoder -rs`` to see which pass and why
others are skipped.
"""

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from dmodule_auto_models import FLOAT32_INSIDE, build_hf, check_auto_parity  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from ndweave.mesh.testing import distributed  # noqa: E402

ALL = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _runs_on_one_process(arch: str) -> str | None:
    """Why ``arch`` cannot be tested from the tiny config, or ``None``."""
    try:
        model = build_hf(arch)
        model(torch.randint(0, 128, (2, 16)))
    except Exception as error:  # noqa: BLE001 (any failure of the model's own code is the reason)
        return f"{arch} does not build and run from the tiny config ({type(error).__name__}: {str(error)[:120]})"
    return None


@distributed(world_size=2, timeout=300)
def _parity(arch: str) -> None:
    # (held to FLOAT32_INSIDE: models that route experts or normalize in float32 whatever their dtype
    # differ from one process by float32 roundings of partial sums; a sharding bug is 1e-4 or more)
    check_auto_parity(arch, sequence_parallel=True, tol=FLOAT32_INSIDE)


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("arch", ALL)
def test_every_decoder(arch):
    why = _runs_on_one_process(arch)
    if why:
        pytest.skip(why)
    _parity(arch)
