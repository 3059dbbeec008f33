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
#: test_fraction_per_registry, reported as xfail here so that the suite stays green while the list is honest.
#: "given example_inputs": what the same case meets when "auto" is handed the batch's shapes (the next fix)
KNOWN_FAILURES: dict[str, str] = {
    "masked_lm/funnel": "DTensor has no sharding strategy for aten.avg_pool2d_backward.default",
    "masked_lm/big_bird": "a full-width reshape the planner does not recognise",
    "masked_lm/reformer": "its backward asserts training mode (one process fails the same: the test runs eval)",
    "masked_lm/mobilebert": "its LM head multiplies by a concatenation holding the vocab-sharded embedding: logits leave sharded",
    "seq2seq/bigbird_pegasus": "a full-width reshape the planner does not recognise",
    "audio_cls/data2vec-audio": "auto cannot guess its inputs; given example_inputs: it matches",
    "audio_cls/hubert": "auto cannot guess its inputs; given example_inputs: it matches",
    "audio_cls/sew": "auto cannot guess its inputs; given example_inputs: DTensor has no sharding strategy for aten.avg_pool2d_backward.default",
    "audio_cls/unispeech": "auto cannot guess its inputs; given example_inputs: it matches",
    "audio_cls/unispeech-sat": "auto cannot guess its inputs; given example_inputs: it matches",
    "audio_cls/wav2vec2": "auto cannot guess its inputs; given example_inputs: it matches",
    "audio_cls/wav2vec2-conformer": "auto cannot guess its inputs; given example_inputs: RuntimeError: The size of tensor a (6) must match the size of tensor b (3) at non-singleton dimension 1",
    "diffusion/pixart": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/beit": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/cvt": "auto cannot guess its inputs; given example_inputs: a plain tensor meets the DTensor stream in aten.cat.default",
    "image_cls/data2vec-vision": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/dinov2": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/dinov2_with_registers": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/focalnet": "auto cannot guess its inputs; given example_inputs: DTensor has no sharding strategy for aten.as_strided_.default",
    "image_cls/hiera": "auto cannot guess its inputs; given example_inputs: DTensor has no sharding strategy for aten.as_strided_.default",
    "image_cls/ijepa": "auto cannot guess its inputs; given example_inputs: AssertionError: Redistribution from one partial type (P(sum)) to another (P(avg)) is unsupported.",
    "image_cls/mobilenet_v1": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/mobilenet_v2": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/poolformer": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/pp_lcnet": "auto cannot guess its inputs; given example_inputs: DTensor has no sharding strategy for aten.hardswish_backward.default",
    "image_cls/pvt": "auto cannot guess its inputs; given example_inputs: ValueError: pvt.encoder.block.2.0.attention: the plan splits its heads / features in pieces of sizes [5, 40]; ",
    "image_cls/pvt_v2": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/regnet": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/resnet": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/swiftformer": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/swinv2": "auto cannot guess its inputs; given example_inputs: DTensor has no sharding strategy for aten.as_strided_.default",
    "image_cls/vit": "auto cannot guess its inputs; given example_inputs: it matches",
    "image_cls/vit_msn": "auto cannot guess its inputs; given example_inputs: it matches",
    "audio_cls/sew-d": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: DTensor has no sharding strategy for aten.avg_pool2d_backward.default",
    "audio_cls/wavlm": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "audio_cls/whisper": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "contrastive/clip": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "contrastive/siglip": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "diffusion/dit": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "image_cls/clip": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "image_cls/metaclip_2": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "image_cls/siglip": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: AssertionError: Redistribution from one partial type (P(sum)) to another (P(avg)) is unsupported.",
    "seq2seq/blenderbot": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/blenderbot-small": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/encoder-decoder": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/longt5": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/m2m_100": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/marian": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/mt5": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/nllb-moe": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/pegasus": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/pegasus_x": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/prophetnet": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: ValueError: replicated_local on 'prophetnet.decoder': weight is laid out (Shard(dim=0),); the patch is for mod",
    "seq2seq/seamless_m4t": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/seamless_m4t_v2": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/switch_transformers": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/t5": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/t5gemma": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq2seq/t5gemma2": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: AttributeError: 'NoneType' object has no attribute 'detach'",
    "seq2seq/umt5": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "speech_seq2seq/moonshine": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "speech_seq2seq/pop2piano": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "speech_seq2seq/speech_to_text": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "speech_seq2seq/speecht5": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "speech_seq2seq/whisper": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
    "seq_cls/mt5": "its forward cannot run on meta (aten::unique_consecutive); given example_inputs: its forward cannot run on meta (aten::unique_consecutive)",
    "seq_cls/t5": "its forward cannot run on meta (aten::unique_consecutive); given example_inputs: its forward cannot run on meta (aten::unique_consecutive)",
    "seq_cls/umt5": "its forward cannot run on meta (aten::unique_consecutive); given example_inputs: its forward cannot run on meta (aten::unique_consecutive)",
}
#: ... and those that fail in one mode only (or for another reason in each)
MODE_FAILURES: dict[str, dict[str, str]] = {
    "tp": {
        "seq_cls/funnel": "DTensor has no sharding strategy for aten.avg_pool2d_backward.default",
        "diffusion/sd3": "auto cannot guess its inputs; given example_inputs: ValueError: forward transformer_blocks.0.attn.input: two patterns disagree (the column-wise linears' input, re",
        "image_cls/segformer": "auto cannot guess its inputs; given example_inputs: it matches",
        "diffusion/flux": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: ValueError: forward transformer_blocks.0.attn.input: two patterns disagree (the column-wise linears' input, re",
        "seq_cls/canine": "the output differs from one process",
    },
    "tp_sp": {
        "peft/gpt2_lora": "the adapter pair is sharded, its base replicated: its row output reduce-scattered on the sequence meets a projection",
        "peft/llama_lora": "the adapter pair is sharded, its base replicated: its row output reduce-scattered on the sequence meets a projection",
        "peft/qwen2_lora": "the adapter pair is sharded, its base replicated: its row output reduce-scattered on the sequence meets a projection",
        "image_cls/imagegpt": "a Partial(sum) meets a Partial(avg)",
        "masked_lm/squeezebert": "a full-width reshape the planner does not recognise",
        "seq_cls/canine": "a full-width reshape the planner does not recognise",
        "seq_cls/squeezebert": "a full-width reshape the planner does not recognise",
        "diffusion/sd3": "auto cannot guess its inputs; given example_inputs: it matches",
        "image_cls/segformer": "auto cannot guess its inputs; given example_inputs: AssertionError: Redistribution from one partial type (P(sum)) to another (P(avg)) is unsupported.",
        "diffusion/flux": "auto's guessed ids (2, 8) do not run its forward; given example_inputs: it matches",
        "seq_cls/funnel": "DTensor has no sharding strategy for aten.avg_pool2d_backward.default",
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
