"""The models users bring beyond decoder LMs, through get_plan("auto") bare (issue #39; slow: the whole
registry takes tens of minutes).

``test_every_model`` is parametrized over transformers' registries (masked LM, encoder sequence
classification, image classification, seq2seq LM, speech seq2seq, audio classification), CLIP and
SigLIP, diffusers' transformers (DiT, SD3, Flux, PixArt) and PEFT LoRA / DoRA on three decoders
(dmodule_any_models.py builds them): a model that does not build and run on one process from its tiny
config is skipped with the reason; every other one is compared with one process under TP and under
TP+SP on 2 ranks, the loss computed outside the model against plain targets (cross-entropy on
labels / tokens / decoder tokens, the contrastive logits against arange, diffusion's MSE against a
random target). ``test_fraction_per_registry`` (last) reports, per registry and mode, how many of
those that build match one process, and xfails below TARGET while the known failures stand.
``test_sample`` (not slow) runs one model per kind in CI. Run with ``-m slow -rA`` (``-k masked_lm``
for one registry) to see which pass, which fail and why others are skipped. Cost: a match is about a
second; a failure kills the 2 ranks and the next test starts new ones (15-25 s on a busy 2-core machine),
so with ~50 failures left the whole file takes 20-30 minutes: left out of CI (pytest.ini's "not slow").
"""

import functools

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch  # noqa: E402
from dmodule_any_models import build_any, check_any_parity, first_batch_that_runs, registries  # noqa: E402
from dmodule_auto_models import FLOAT32_INSIDE  # noqa: E402

from ndweave.mesh.testing import STRICT_DTYPE, distributed  # noqa: E402

REGISTRIES = registries()
ALL = [f"{registry}/{name}" for registry, names in REGISTRIES.items() for name in names]
MODES = {"tp": False, "tp_sp": True}  # test id -> sequence_parallel
OUTCOMES: dict[str, dict[str, bool]] = {m: {} for m in MODES}  # mode -> case -> whether it matched
SKIPPED: set[str] = set()  # cases that do not build and run from the tiny config
MAX_PARAMETERS = 10_000_000
TARGET = 0.9  # the fraction per registry the issue aims at
#: one per kind, run in CI (not slow), in one mode each: an encoder, LoRA adapters, a vision model, a diffusion
#: transformer
SAMPLE = {"masked_lm/bert": "tp_sp", "peft/llama_dora": "tp", "image_cls/vit": "tp", "diffusion/dit": "tp_sp"}
#: the cases "auto" (bare: no example_inputs) does not yet match, and why: counted as failures by
#: test_fraction_per_registry, reported as xfail here so that the suite stays green while the list is honest
KNOWN_FAILURES: dict[str, str] = {
    "masked_lm/big_bird": "a full-width reshape the planner does not recognise",
    "masked_lm/mobilebert": "its LM head multiplies by a concatenation holding the vocab-sharded embedding: logits leave sharded",
    "seq2seq/bigbird_pegasus": "a full-width reshape the planner does not recognise",
    "seq2seq/prophetnet": "its decoder looks up n-gram embeddings in its own forward: replicated_local meets its "
                          "vocab-parallel word embeddings",
    "image_cls/cvt": "a split of the stream whose unused piece's zero gradient comes back plain (aten.cat of a tensor "
                     "and a DTensor in the backward)",
    "image_cls/pvt": "5 heads: the error asks for a tensor-parallel size dividing 5",
}
#: ... and those that fail in one mode only (or for another reason in each)
MODE_FAILURES: dict[str, dict[str, str]] = {
    "tp": {
        "seq_cls/canine": "the output differs from one process",
    },
    "tp_sp": {
        "seq_cls/canine": "a full-width reshape the planner does not recognise",
    },
}


@functools.cache
def _runs_on_one_process(case: str) -> tuple[str | None, int]:
    """Why ``case`` cannot be tested from the tiny config (or ``None``), and the batch it runs on."""
    SKIPPED.add(case)
    default = torch.get_default_dtype()
    try:
        with torch.device("meta"):  # first on meta: some configs keep sizes the tiny one does not set
            size = sum(p.numel() for p in build_any(case).parameters())
        if size > MAX_PARAMETERS:
            return f"{case} is not tiny from the tiny config ({size / 1e6:.0f}M parameters)", 0
        torch.set_default_dtype(STRICT_DTYPE)
        torch.manual_seed(0)
        model = build_any(case).eval()
        candidate = first_batch_that_runs(case, model)
    except Exception as error:  # noqa: BLE001 (any failure of the model's own code is the reason)
        return f"{case} does not build and run from the tiny config ({type(error).__name__}: {str(error)[:120]})", 0
    finally:
        torch.set_default_dtype(default)
    SKIPPED.discard(case)
    return None, candidate


@distributed(world_size=2, timeout=300)
def _parity(case: str, sequence_parallel: bool, candidate: int) -> None:
    # (held to FLOAT32_INSIDE: parts transformers runs in float32 whatever the dtype round partial sums;
    # a sharding bug is 1e-4 or more)
    check_any_parity(case, sequence_parallel=sequence_parallel, steps=1, tol=FLOAT32_INSIDE, candidate=candidate)


def _check(case: str, mode: str) -> None:
    why, candidate = _runs_on_one_process(case)
    if why:
        pytest.skip(why)
    OUTCOMES[mode][case] = False
    try:
        _parity(case, MODES[mode], candidate)
    except Exception:
        known = {**KNOWN_FAILURES, **MODE_FAILURES[mode]}
        if case in known:
            pytest.xfail(f"{case}: {known[case]}")
        raise
    OUTCOMES[mode][case] = True


@pytest.mark.parity
@pytest.mark.parametrize("case", SAMPLE)
def test_sample(case):
    """One model per kind, in one mode each (CI's share of ``test_every_model``)."""
    _check(case, SAMPLE[case])


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ALL)
def test_every_model(case, mode):
    _check(case, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("registry", REGISTRIES)
def test_fraction_per_registry(registry, mode):
    """Run after ``test_every_model`` over the registry (``-k`` may select one registry): of its cases
    that build and run from the tiny config, the fraction that matches one process in ``mode``."""
    cases = {f"{registry}/{name}" for name in REGISTRIES[registry]}
    outcomes = {case: ok for case, ok in OUTCOMES[mode].items() if case in cases}
    if set(outcomes) | (SKIPPED & cases) != cases:
        pytest.skip(f"test_every_model[{mode}] did not run over every {registry} model in this session")
    if not outcomes:
        pytest.skip(f"no {registry} model builds and runs from the tiny config")
    passed = sorted(c for c, ok in outcomes.items() if ok)
    failed = sorted(c for c, ok in outcomes.items() if not ok)
    fraction = len(passed) / len(outcomes)
    summary = (f"auto plan, {mode} on 2 ranks: {len(passed)} of {len(outcomes)} {registry} models that build match "
               f"one process ({fraction:.0%}; {len(cases & SKIPPED)} skipped); failed: {', '.join(failed) or 'none'}")
    print(summary)
    if fraction < TARGET and all(c in KNOWN_FAILURES or c in MODE_FAILURES[mode] for c in failed):
        pytest.xfail(summary)  # (below the target, every failure known: the honest count of issue #39)
    assert fraction >= TARGET, summary
