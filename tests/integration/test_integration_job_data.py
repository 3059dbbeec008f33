"""The main job on your data (``--data``, ``ndweave-data``): a tiny HF Llama fine-tuned from a
``save_pretrained`` folder with a tokenizer trained on the fly beside it, on a ``.jsonl``, documents
packed apart (position ids and the document mask passed to the model, the boundaries' loss masked):

* the loss falls, and a second run reuses the prepared shards;
* a packed batch's summed loss and every gradient equal its documents' run one by one (what the job
  feeds transformers' Llama and its GPT: position ids and the 4-D document mask);
* a run saved at DP=2 and resumed at PP=2 trains on the same batches as the uninterrupted run: the
  losses after the resume equal its (float64);
* a data file changed under a checkpoint is refused naming both data hashes (``--allow-data-change``
  lets it go on);
* token ids at or past the model's vocabulary are refused, naming the model's size;
* SFT on chats mixed with plain text, validated on --val-data: only the assistant's tokens trained on;
* 8 ranks launched by torchrun, as users launch them: SFT mixed with text at PP=2 x DP=2 x TP=2, its own
  ``--compare-single-device`` passing, ``--sample`` decoded, exported; resumed at DP=4, DP=1 x TP=2,
  PP=2 and on one process, every resume's later losses equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ndweave.checkpoint import CheckpointManager
from ndweave.mesh.testing import assert_close, run_distributed
from ndweave_gpt.config import parse_args
from ndweave_gpt.models import hf as hf_models
from test_integration_gpt_job import TINY, _run
from test_integration_gpt_job import _resume_refused as _refused  # (the job's exit message, on each rank)

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

WORDS = ("the cat sat on a mat while the dog ran to the park and a bird sang over the quiet river bank "
         "as the sun went down behind the old mill near the village green").split()


def _texts(count: int, seed: int = 0) -> list[str]:
    """Short documents of a small vocabulary (a tokenizer trained on them learns whole words)."""
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (int(n),), generator=g))
            for n in torch.randint(3, 12, (count,), generator=g)]


def _jsonl(path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _tokenizer(folder, vocab_size: int = 300) -> int:
    """A byte-level BPE tokenizer trained on the fly, saved as transformers saves one; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_texts(200, seed=1), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return len(fast)


def _llama(folder, vocab_size: int | None = None, tokenizer: bool = True, block_size: int = 16) -> None:
    """A tiny Llama as users have one: ``save_pretrained``, its tokenizer beside it (sized to it)."""
    import transformers

    folder.mkdir()
    size = _tokenizer(folder) if tokenizer else 256
    config = hf_models.hf_config("llama", "tiny", block_size=block_size)
    config.vocab_size = vocab_size or size
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


#: a chat template as tokenizer_config.json holds one (transformers renders it)
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _chats(path, count: int) -> str:
    """Short two-turn chats as ``{"messages": [...]}`` records."""
    words = [t.split() for t in _texts(2 * count, seed=5)]
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a[0]},
                                                     {"role": "assistant", "content": " ".join(b[:2])}]}) + "\n"
                            for a, b in zip(words[::2], words[1::2])))
    return str(path)


@pytest.mark.parity
def test_job_fine_tunes_a_llama_folder_on_a_jsonl_with_its_tokenizer(tmp_path):
    _llama(tmp_path / "llama")
    data = _jsonl(tmp_path / "train.jsonl", _texts(300))
    argv = [*TINY, "--init-from", str(tmp_path / "llama"), "--data", data, "--mesh", "dp=2", "--steps", "8",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    args = parse_args(argv)
    assert args.data.tokenizer == str(tmp_path / "llama") and args.data.packing == "auto"
    first = run_distributed(_run, 2, argv, timeout=300)[0]
    losses = [first.losses[s] for s in sorted(first.losses)]
    assert losses[-1] < losses[0] - 0.3, losses  # from about ln(vocab) down
    # exported with its tokenizer, the fine-tuned model loads back as transformers' own, from one folder
    import transformers
    from ndweave_gpt.export_hf import export_hf

    out = export_hf(tmp_path / "ckpt", tmp_path / "exported", args.data.tokenizer)
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    original = transformers.AutoTokenizer.from_pretrained(tmp_path / "llama")
    assert reloaded("the cat sat")["input_ids"] == original("the cat sat")["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.vocab_size == len(reloaded)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, len(reloaded))
    prepared = list((tmp_path / "ckpt" / "prepared").iterdir())
    assert len(prepared) == 1 and (prepared[0] / "manifest.json").is_file()
    manifest = json.loads((prepared[0] / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["eos_id"] is not None and manifest["num_documents"] == 300


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_a_packed_batch_trains_as_its_documents_one_by_one(tmp_path, model):
    """The job's batch (``--packing documents``: position ids restarting, the document mask) through
    transformers' Llama and the job's GPT on one process, float64: the summed loss over the trained
    targets and every gradient equal the sum over its documents run one by one, unpacked, from
    position 0; so no token attends across a boundary and none is trained across one."""
    import torch.nn.functional as F

    from ndweave.checkpoint import DataPosition
    from ndweave_gpt.build import build_model
    from ndweave_gpt.data.tokens import IGNORE, TokenData

    data = _jsonl(tmp_path / "train.jsonl", _texts(40))
    if model == "llama":
        from transformers import AutoModelForCausalLM

        _llama(tmp_path / "llama")
        args = parse_args([*TINY, "--init-from", str(tmp_path / "llama"), "--data", data,
                           "--checkpoint-dir", str(tmp_path)])
        net = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float64)
        vocab = args.model.hf_config.vocab_size
    else:
        args = parse_args([*TINY, "--data", data, "--checkpoint-dir", str(tmp_path)])
        net, vocab = build_model(args), 256
    tokens = TokenData(args, vocab, rank=0)
    assert tokens.packing == "documents"
    inputs, targets = tokens.batch(DataPosition(), 8)

    def loss(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")

    def grads():
        out = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        net.zero_grad()
        return out

    packed = loss(net(**inputs)[0], targets)
    packed.backward()
    packed_grads = grads()
    alone, pieces = 0.0, 0
    for row in range(8):
        starts = (inputs["position_ids"][row] == 0).nonzero().flatten().tolist() + [16]
        for begin, end in zip(starts, starts[1:]):
            piece = loss(net(inputs["input_ids"][row:row + 1, begin:end])[0], targets[row:row + 1, begin:end])
            piece.backward()
            alone, pieces = alone + piece.detach(), pieces + 1
        # the target crossing into the next document is not trained on
        assert all(targets[row, s - 1] == IGNORE for s in starts[1:-1])
    assert pieces > 8  # some sample held more than one document
    assert_close(packed.detach(), alone, name="summed loss")
    for name, grad in grads().items():
        assert_close(packed_grads[name], grad, name=f"grad of {name}")


@pytest.mark.parity
@pytest.mark.parametrize("model, first", [("llama", "dp=2"), ("gpt", "tp=2")])
def test_a_run_resumed_on_another_mesh_trains_on_the_same_batches(tmp_path, model, first):
    """Saved after step 2 at DP=2 (the Llama) or TP=2 with SP (the GPT: the document mask beside its
    sequence-sharded stream), resumed at PP=2 (the position ids and the document mask crossing the
    stages): steps 3 and 4 equal the uninterrupted run's (float64)."""
    data = _jsonl(tmp_path / "train.jsonl", _texts(120))
    if model == "llama":
        _llama(tmp_path / "llama")
        data = [data, "--init-from", str(tmp_path / "llama")]
    else:
        data = [data, "--packing", "documents"]
    base = [*TINY, "--data", *data, "--steps", "4", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    whole = run_distributed(_run, 2, [*base, "--mesh", first], timeout=300)[0]
    shutil.rmtree(CheckpointManager(str(tmp_path / "ckpt")).path(4))  # as if stopped after step 2's checkpoint
    resumed = run_distributed(_run, 2, [*base, "--mesh", "pp=2", "--resume"], timeout=300)
    for rank, result in enumerate(resumed):
        assert sorted(result.losses) == [3, 4], result.losses
        assert_close(torch.tensor([result.losses[s] for s in (3, 4)], dtype=torch.float64),
                     torch.tensor([whole.losses[s] for s in (3, 4)], dtype=torch.float64),
                     name=f"steps 3-4 resumed at PP=2, rank {rank}")


@pytest.mark.parity
def test_changed_data_under_a_checkpoint_is_refused_naming_both_hashes(tmp_path):
    _llama(tmp_path / "llama")
    data = tmp_path / "train.jsonl"
    _jsonl(data, _texts(60))
    base = [*TINY, "--init-from", str(tmp_path / "llama"), "--data", str(data), "--mesh", "dp=2",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    run_distributed(_run, 2, [*base, "--steps", "1"], timeout=300)
    _jsonl(data, _texts(61))  # another file: another prepared hash
    messages = run_distributed(_refused, 2, [*base, "--steps", "2", "--resume"], timeout=300)
    hashes = sorted(p.name for p in (tmp_path / "ckpt" / "prepared").iterdir())
    assert len(hashes) == 2
    for message in messages:
        assert "trained on other data" in message and all(h in message for h in hashes), message
    allowed = run_distributed(_run, 2, [*base, "--steps", "2", "--resume", "--allow-data-change"], timeout=300)[0]
    assert sorted(allowed.losses) == [2]


def test_token_ids_past_the_models_vocabulary_are_refused(tmp_path):
    """A tokenizer of 300 ids with a model of 256: refused on every rank, nothing trained."""
    _llama(tmp_path / "llama", vocab_size=256)
    data = _jsonl(tmp_path / "train.jsonl", _texts(20))
    argv = [*TINY, "--init-from", str(tmp_path / "llama"), "--data", data, "--mesh", "dp=2", "--steps", "1",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    messages = run_distributed(_refused, 2, argv, timeout=300)
    for message in messages:
        assert "--data" in message and "outside the vocabulary of 256" in message and "hf:llama" in message, message


def test_the_estimate_prices_the_packed_inputs_within_5_percent(tmp_path):
    """``--estimate`` and ``--mesh auto`` run on what ``--data`` feeds (position ids and the document mask,
    through a PP=2 cut): each rank's estimated peak is within 5% of the steps' measured one. (At 64
    positions the mask is ~1% of the peak: this holds the estimate with --data, not the mask's share.)"""
    from ndweave_gpt.cost import memory_estimate

    _llama(tmp_path / "llama", block_size=64)
    data = _jsonl(tmp_path / "train.jsonl", _texts(120))
    argv = [*TINY, "--block-size", "64", "--init-from", str(tmp_path / "llama"), "--data", data, "--mesh", "pp=2",
            "--steps", "2", "--memory-check", "--checkpoint-dir", str(tmp_path / "ckpt")]
    measured = run_distributed(_run, 2, argv, timeout=300)[0].tensor_peak
    ratios = [e.peak / m for e, m in zip(memory_estimate(parse_args(argv)), measured)]
    assert all(0.95 <= r <= 1.05 for r in ratios), ratios


def test_flags_data_refuses_before_launch(tmp_path):
    """What --data cannot run with, refused as argparse refuses a flag."""
    with pytest.raises(SystemExit):
        parse_args([*TINY, "--tokenizer", str(tmp_path)])  # no --data
    with pytest.raises(SystemExit):
        parse_args([*TINY, "--data", "x.jsonl", "--eval-every", "2"])  # no --val-data
    args = parse_args([*TINY, "--data", "a.jsonl:0.7", "b/:0.3"])
    assert args.data.data == ("a.jsonl:0.7", "b/:0.3") and args.model.vocab_size == 0
    # a model built here takes its tokenizer's vocabulary: nanogpt and an hf: preset alike
    size = _tokenizer(tmp_path / "tokenizer")
    for model in (["--model", "nanogpt"], ["--model", "hf:llama"]):
        args = parse_args([*TINY, *model, "--tokenizer", str(tmp_path / "tokenizer"), "--data", "a.jsonl"])
        assert args.model.vocab_size == size and (args.model.hf_config is None or args.model.hf_config.vocab_size == size)


@pytest.mark.parity
def test_sft_chats_mixed_with_text_train_on_the_assistants_tokens_only(tmp_path):
    """Chat records (the tokenizer's chat template) mixed 1:1 with plain text, --val-data every step, at
    DP=2; one process checks the chats' trained targets are the assistant's words and end-of-text only."""
    from ndweave.checkpoint import DataPosition
    from ndweave_gpt.data.tokens import IGNORE, TokenData

    _chat_llama(tmp_path)
    chats = _chats(tmp_path / "chats.jsonl", 40)
    plain, held_out = _jsonl(tmp_path / "plain.jsonl", _texts(40)), _jsonl(tmp_path / "val.jsonl", _texts(20, seed=2))
    base = [*TINY, "--init-from", str(tmp_path / "llama"), "--packing", "documents", "--steps", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    result = run_distributed(_run, 2, [*base, "--data", f"{chats}:0.5", f"{plain}:0.5", "--val-data", held_out,
                                       "--eval-every", "1", "--mesh", "dp=2"], timeout=300)[0]
    assert sorted(result.losses) == sorted(result.val_losses) == [1, 2]
    assert all(0 < v < 10 for v in [*result.losses.values(), *result.val_losses.values()])

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama")
    args = parse_args([*base, "--data", chats])
    _, targets = TokenData(args, args.model.hf_config.vocab_size, rank=0).batch(DataPosition(), 8)
    trained = tokenizer.decode(targets[targets != IGNORE].tolist())
    assert "<|user|>" not in trained and "<|assistant|>" not in trained and trained.count("<|endoftext|>") > 0
    assert 0 < (targets != IGNORE).sum() < targets.numel() // 2
    # through the job's loss, the prompt's logits get no gradient, the assistant's do
    from ndweave_gpt.build import MaskedLoss

    logits = torch.randn(*targets.shape, len(tokenizer), dtype=torch.float64, requires_grad=True)
    MaskedLoss()(logits, targets).backward()
    per_token = logits.grad.abs().sum(-1)
    assert (per_token[targets == IGNORE] == 0).all() and (per_token[targets != IGNORE] > 0).all()


def _chat_llama(tmp_path, block_size: int = 16):
    """The tiny Llama with a chat template in its tokenizer folder."""
    _llama(tmp_path / "llama", block_size=block_size)
    settings = json.loads((tmp_path / "llama" / "tokenizer_config.json").read_text())
    (tmp_path / "llama" / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": TEMPLATE}))


@pytest.mark.parity
@pytest.mark.heavy
def test_sft_on_eight_ranks_compares_exports_and_resumes_on_any_mesh(tmp_path):
    """The job as users run it: ``torchrun`` with 8 processes fine-tunes a tiny Llama (64 positions) at
    PP=2 x DP=2 x TP=2 on chats packed first-fit (SFT) mixed 1:1 with plain text, in float64; its
    ``--compare-single-device`` passes, ``--sample`` is the tokenizer's text, and the export loads back.
    The checkpoint after step 2 is resumed at DP=4, DP=1 x TP=2, PP=2 and on one process: steps 3 and 4
    equal the uninterrupted run's (a sample read differently would change them)."""
    _chat_llama(tmp_path, block_size=64)
    data = [f"{_chats(tmp_path / 'chats.jsonl', 120)}:0.5", f"{_jsonl(tmp_path / 'plain.jsonl', _texts(120))}:0.5"]
    base = [*TINY, "--block-size", "64", "--init-from", str(tmp_path / "llama"), "--data", *data, "--steps", "4",
            "--data-cache", str(tmp_path / "prepared")]
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
                           "-m", "ndweave_gpt", *base, "--mesh", "pp=2,dp=2,tp=2", "--checkpoint-every", "2",
                           "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics", str(metrics), "--sample", "6",
                           "--compare-single-device", "--export-hf", str(tmp_path / "exported")],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    out = done.stdout
    assert done.returncode == 0 and "PASS" in out, out[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    whole = {row["step"]: row["loss"] for row in rows}
    assert sorted(whole) == [1, 2, 3, 4]
    counted = [row["tokens_s"] * row["step_s"] for row in rows]  # the tokens each step's throughput counts
    assert all(0 < c < 8 * 64 - 1 for c in counted), counted  # first-fit's padding is not counted
    written = out.split("sample:\n", 1)[1].splitlines()[0]
    assert sum(w in WORDS for w in written.split()) >= 2, out[-2000:]  # the tokenizer's words, not its ids as bytes

    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert tokenizer.chat_template == TEMPLATE and reloaded.config.vocab_size == len(tokenizer)

    for mesh, ranks in (("dp=4", 4), ("dp=1,tp=2", 2), ("pp=2", 2), ("dp=1", 1)):
        checkpoints = tmp_path / f"resume-{mesh}"
        saved = CheckpointManager(str(tmp_path / "ckpt")).path(2)
        shutil.copytree(saved, checkpoints / saved.name)
        argv = [*base, "--mesh", mesh, "--resume", "--checkpoint-dir", str(checkpoints)]
        resumed = run_distributed(_run, ranks, argv, timeout=300)[0]
        assert sorted(resumed.losses) == [3, 4], (mesh, resumed.losses)
        assert_close(torch.tensor([resumed.losses[s] for s in (3, 4)], dtype=torch.float64),
                     torch.tensor([whole[s] for s in (3, 4)], dtype=torch.float64), name=f"steps 3-4 resumed at {mesh}")
