"""The main job on what users bring (``python -m ndweave_gpt --model hf:... --init-from ...``), float64
strict, against one process starting from what transformers itself loads:

* HF Llama (a ``model.safetensors`` folder, the LM head tied to the embedding and stored once) at
  PP=2 x DP=2 x TP(+SP)=2 from ``--init-from``: every
  step's loss and the final parameters; then the job's checkpoint exported (``python -m ndweave_gpt.export_hf``) and
  loaded by ``AutoModelForCausalLM.from_pretrained``: the trained parameters and their logits;
* HF Qwen2 (sharded safetensors with an index, the "auto" plan) at PP=2 x DP=2 x
  TP=2 with ``--activation-checkpointing``: equal to one process without it;
* HF Mixtral (the tiny preset, 4 experts) at PP=2 x EP=2, the experts over EP: one process;
* nanoGPT from a torch ``.pt`` state dict, and with activation checkpointing at PP=2 x TP=2;
* the flags the job refuses, and the MFU estimate's formula.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ndweave.mesh.testing import assert_close, run_distributed
from ndweave_gpt import report
from ndweave_gpt.build import build_model, plan_name
from ndweave_gpt.config import num_experts, parse_args
from ndweave_gpt.models import hf as hf_models
from ndweave_gpt.reference import train_single_device
from test_integration_gpt_job import TINY, _check, _check_params, _run


def _hf_folder(folder, model_type: str, **save) -> None:
    """A pretrained transformers checkpoint as users have one: saved by ``save_pretrained`` (float32)."""
    transformers = pytest.importorskip("transformers")
    config = hf_models.hf_config(model_type, "tiny", block_size=16)
    # Llama tied as Qwen2's small models are (the head stored once, read through the job's aliases;
    # the zoo's hf_llama plan keeps the tie one Shard(0) tensor), Qwen2 untied
    config.tie_word_embeddings = model_type == "llama"
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, **save)


def _pretrained(folder, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def _logits(model, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    if params is not None:
        model.load_state_dict(params, strict=False)  # a tied head: one tensor, both names given
    ids = torch.arange(32).reshape(2, 16) * 7 % 256
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parity
@pytest.mark.heavy
def test_hf_llama_from_a_pretrained_folder_on_pp2_dp2_tp2_equals_one_process_and_exports_back(tmp_path):
    source, out = tmp_path / "llama", tmp_path / "exported"
    _hf_folder(source, "llama")
    argv = [*TINY, "--init-from", str(source), "--mesh", "pp=2,dp=2,tp=2", "--steps", "3",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    results = run_distributed(_run, 8, argv, timeout=500)
    args = parse_args(argv)
    assert args.model.name == "hf:llama" and plan_name(args) == "hf_llama"
    reference = train_single_device(args, model=_pretrained(source))
    for rank, result in enumerate(results):
        _check(result, reference, f"hf:llama PP=2 x DP=2 x TP=2, rank {rank}")
        _check_params(result, reference, f"hf:llama PP=2 x DP=2 x TP=2, rank {rank}")

    # the module's entry on the checkpoint folder (the job's --export-hf runs it at the end)
    subprocess.run([sys.executable, "-m", "ndweave_gpt.export_hf", str(tmp_path / "ckpt"), str(out)],
                   check=True, timeout=300)
    exported = _pretrained(out, dtype="auto")
    assert next(exported.parameters()).dtype == torch.float64  # the config says the weights' dtype
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), results[0].params[name]), name
    assert_close(_logits(exported), _logits(_pretrained(source), results[0].params), name="exported logits")


@pytest.mark.parity
@pytest.mark.heavy
def test_hf_qwen2_sharded_with_activation_checkpointing_on_pp2_dp2_tp2_equals_one_process(tmp_path):
    source = tmp_path / "qwen2"
    _hf_folder(source, "qwen2", max_shard_size="40KB")
    assert (source / "model.safetensors.index.json").is_file()
    argv = [*TINY, "--init-from", str(source), "--mesh", "pp=2,dp=2,tp=2", "--steps", "3",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    results = run_distributed(_run, 8, [*argv, "--activation-checkpointing"], timeout=500)
    args = parse_args(argv)
    assert args.model.name == "hf:qwen2" and plan_name(args) == "auto"
    reference = train_single_device(args, model=_pretrained(source))  # without activation checkpointing
    for rank, result in enumerate(results):
        _check(result, reference, f"hf:qwen2 PP=2 x DP=2 x TP=2, rank {rank}")
        _check_params(result, reference, f"hf:qwen2 PP=2 x DP=2 x TP=2, rank {rank}")


@pytest.mark.parity
def test_nanogpt_from_a_torch_state_dict_and_with_activation_checkpointing_match_one_process(tmp_path):
    """A torch-only user's ``.pt`` state dict at PP=2 x TP=2 (each rank reading its slices of the
    memory-mapped file), with activation checkpointing per block: one process without it."""
    pretrained = build_model(parse_args([*TINY, "--seed", "5"]))  # not the weights --seed 1234 builds
    torch.save(pretrained.state_dict(), tmp_path / "gpt.pt")
    argv = [*TINY, "--init-from", str(tmp_path / "gpt.pt"), "--mesh", "pp=2,tp=2", "--steps", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    results = run_distributed(_run, 4, [*argv, "--activation-checkpointing"], timeout=300)
    reference = train_single_device(parse_args(argv), model=pretrained)
    for rank, result in enumerate(results):
        _check(result, reference, f"nanogpt from gpt.pt, PP=2 x TP=2, rank {rank}")
        _check_params(result, reference, f"nanogpt from gpt.pt, PP=2 x TP=2, rank {rank}")


@pytest.mark.parity
@pytest.mark.heavy
def test_hf_mixtral_with_experts_over_ep_on_pp2_ep2_equals_one_process(tmp_path):
    """``--model hf:mixtral --config tiny --moe-experts 4`` at PP=2 x EP=2: the zoo's hf_mixtral plan
    divides each stage's experts over EP (EP ranks splitting the batch), trained like one process."""
    pytest.importorskip("transformers")
    argv = [*TINY, "--model", "hf:mixtral", "--moe-experts", "4", "--moe-top-k", "2", "--mesh", "pp=2,ep=2",
            "--steps", "3", "--checkpoint-dir", str(tmp_path)]
    results = run_distributed(_run, 4, argv, timeout=500)
    args = parse_args(argv)
    assert plan_name(args) == "hf_mixtral" and num_experts(args) == 4
    reference = train_single_device(args)
    for rank, result in enumerate(results):
        assert result.mesh == "PP=2 x DP=1 x EP=2 x TP=1", result.mesh
        _check(result, reference, f"hf:mixtral PP=2 x EP=2, rank {rank}")
        _check_params(result, reference, f"hf:mixtral PP=2 x EP=2, rank {rank}")


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as refused:
        parse_args(argv)
    return str(refused.value) + capsys.readouterr().err  # argparse's errors go to stderr


@pytest.mark.parametrize("flags, message", [
    (["--model", "llama"], "--model llama: use nanogpt or hf:<model_type>"),
    (["--model", "hf:no_such_model"], "transformers has no model type 'no_such_model'"),
    (["--export-hf", "out"], "--export-hf writes a transformers model: train one with --model hf:<model_type>"),
    (["--init-from", "/no/such/folder"], "--init-from /no/such/folder: no such folder or file"),
    (["--model", "hf:llama", "--block-size", "65", "--config", "{config}"], "--block-size 65 is longer than the "
     "model's 64 positions"),
    (["--model", "hf:qwen2", "--config", "{config}"], "is a 'llama' model, not hf:qwen2: pass --model hf:llama"),
    (["--model", "hf:llama", "--config", "{small_vocab}"], "the model's vocabulary has 100 ids"),
])
def test_model_flags_the_job_cannot_run_are_named(flags, message, tmp_path, capsys):
    pytest.importorskip("transformers")
    config = hf_models.hf_config("llama", "tiny", block_size=64)
    config.to_json_file(tmp_path / "config.json")
    config.vocab_size = 100
    config.to_json_file(tmp_path / "small.json")
    flags = [f.format(config=tmp_path / "config.json", small_vocab=tmp_path / "small.json") for f in flags]
    assert message in _refused([*TINY, *flags], capsys)


def test_mfu_is_model_flops_over_the_devices_peak():
    """6 FLOPs per parameter per token (forward 2, backward 4) plus attention's 12 x layers x width x
    sequence (PaLM's appendix B), over the peak of every device; no peak known: no estimate."""
    flops = report.flops_per_token(num_params=1_000_000, num_layers=4, width=128, seq_len=64)
    assert flops == 6 * 1_000_000 + 12 * 4 * 128 * 64
    assert report.mfu(flops, tokens_per_s=1e5, peak_flops=1e12, devices=4) == pytest.approx(flops * 1e5 / 4e12)
    assert report.mfu(flops, tokens_per_s=1e5, peak_flops=None, devices=4) is None
    assert report.peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert report.peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert report.peak_flops("cpu", torch.float32) is None
