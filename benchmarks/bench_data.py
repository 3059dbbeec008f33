"""ndweave-data's tokenizing against ``datasets.map``, and the job's loader against its step.

    python benchmarks/bench_data.py                      # 2 tokenizing workers; the job at its defaults
    python benchmarks/bench_data.py --quick

Tokenizing. A corpus of ``--documents`` generated documents (a ``.jsonl`` of ``text`` records) and a
byte-level BPE tokenizer of ``--vocab`` ids trained on it, saved as transformers saves one (the folder
users have); both sides tokenize the corpus with that same tokenizer, into a fresh folder each round,
interleaved for ``--rounds`` rounds (medians):

* ``prepare``: ``ndweave.data.prepare(jsonl, tokenizer, out, workers=W)``: read, tokenize, write the
  token shards (uint16) and the document index a ``PackedDataset`` reads by position;
* ``datasets.map``: ``load_dataset("json")`` then ``.map(tokenize, batched=True, num_proc=W)`` into its
  arrow cache, what Hugging Face users run (ids in arrow, no shards or index).

Each timed as wall time and as the CPU time of the process and its workers (``os.times``, children
included); tokens/s is the corpus's tokens over the wall time.

The loader's share of a step. The job at its defaults (``pp=2,dp=2,tp=2``, nanogpt) launched by
torchrun on the corpus with ``--data`` (the corpus' UTF-8 bytes, ``--packing concat``), and again as an
``hf:llama`` with the tokenizer and ``--packing documents`` (position ids and the document mask built
every step): rank 0's ``data_s`` (reading its batch, to the device) over ``step_s`` from the job's
``--metrics``, medians of the steps after the first. Both are wall times of the same rank in the same
steps, so the ranks' contention for the cores slows both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Row, emit

WORDS = ("time day year way thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact the of and to in is was for on that with as it by at "
         "from this have not but had his they were are which one you all an she there been their more if").split()


def corpus(folder: Path, documents: int) -> Path:
    """``documents`` records of 20-400 words (a fixed seed) as a ``.jsonl``."""
    rng = random.Random(0)
    path = folder / "corpus.jsonl"
    with path.open("w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))}) + "\n")
    return path


def tokenizer_folder(folder: Path, data: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer trained on ``data``, saved as ``PreTrainedTokenizerFast.save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with data.open() as f:
        tokenizer.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    out = folder / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(out)
    return out


def timed(fn) -> tuple[float, float, object]:
    """``fn()``'s wall time and CPU time (this process and the workers it waited for), and its result."""
    wall, cpu = time.perf_counter(), os.times()
    result = fn()
    end = os.times()
    used = sum(getattr(end, k) - getattr(cpu, k) for k in ("user", "system", "children_user", "children_system"))
    return time.perf_counter() - wall, used, result


def prepare_once(data: Path, tokenizer, out: Path, workers: int) -> int:
    from ndweave.data import prepare

    shards = prepare(data, tokenizer, out, workers=workers, eos_id=tokenizer.eos_token_id,
                     vocab_size=len(tokenizer))
    return int(shards.lengths.sum())


def map_once(data: Path, tokenizer, cache: Path, workers: int) -> int:
    import datasets

    eos = tokenizer.eos_token_id
    table = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(cache))
    ids = table.map(lambda batch: {"input_ids": [t + [eos] for t in tokenizer(batch["text"])["input_ids"]]},
                    batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    return sum(len(t) for t in ids["input_ids"])


def tokenizing(folder: Path, data: Path, tokenizer_dir: Path, workers: int, rounds: int) -> Row:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sides = {"prepare": lambda out: prepare_once(data, tokenizer, out, workers),
             "datasets.map": lambda out: map_once(data, tokenizer, out, workers)}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    tokens = {}
    for r in range(rounds):
        for name, run in sides.items():
            out = folder / f"{name}-{r}"
            wall, cpu, tokens[name] = timed(lambda: run(out))
            shutil.rmtree(out, ignore_errors=True)
            times[name].append((wall, cpu))
    assert tokens["prepare"] == tokens["datasets.map"], tokens  # the same tokens, eos included
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    for name in sides:
        print(f"{name:>14}: {wall[name]:6.2f} s wall, {cpu[name]:6.2f} s CPU, {tokens[name] / wall[name]:,.0f} tokens/s")
    return Row("ndweave.data.prepare", "datasets.map, same tokenizer", workers, wall["prepare"] / wall["datasets.map"],
               cpu["prepare"] / cpu["datasets.map"],
               note=f"{tokens['prepare'] / wall['prepare'] / 1e6:.2f}M vs "
                    f"{tokens['datasets.map'] / wall['datasets.map'] / 1e6:.2f}M tokens/s; "
                    f"{tokens['prepare'] / 1e6:.1f}M tokens, {workers} workers")


def loader_share(folder: Path, data: Path, tokenizer_dir: Path, steps: int, flags: list[str]) -> tuple[float, float]:
    """The job launched with ``flags`` on ``data``: medians of rank 0's ``data_s`` and ``step_s``."""
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    run = folder / "run"
    shutil.rmtree(run, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
                           "-m", "ndweave_gpt", "--data", str(data), "--steps", str(steps), "--quiet", "--plot", "",
                           "--metrics", str(metrics), "--checkpoint-dir", str(run), "--checkpoint-every", "0",
                           *flags], cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise SystemExit(f"the job failed:\n{done.stdout[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][1:]  # the first step traces shapes
    return statistics.median(r["data_s"] for r in rows), statistics.median(r["step_s"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="the job's steps for the loader's share")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--json", metavar="PATH", default=None, help="append the result rows (run_all.py)")
    # run_all.py passes every benchmark these; the job sets its own device and threads
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()
    if a.quick:
        a.documents, a.rounds, a.steps = 500, 1, 4
    folder = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        data = corpus(folder, a.documents)
        tokenizer_dir = tokenizer_folder(folder, data, a.vocab)
        rows = [tokenizing(folder, data, tokenizer_dir, a.workers, a.rounds)]
        for what, flags in (("nanogpt, bytes, concat", ["--packing", "concat"]),
                            ("hf:llama, tokenizer, documents", ["--model", "hf:llama", "--tokenizer",
                                                                str(tokenizer_dir), "--packing", "documents"])):
            reading, step = loader_share(folder, data, tokenizer_dir, a.steps, flags)
            print(f"loader, {what}: {reading * 1e3:.2f} ms of a {step * 1e3:.0f} ms step ({reading / step:.2%})")
            rows.append(Row("job --data loader", f"its step ({what})", 8, reading / step, float("nan"),
                            bound="< 2% of the step (issue #40)",
                            note=f"rank 0: {reading * 1e3:.2f} ms reading of a {step * 1e3:.0f} ms step, pp=2,dp=2,tp=2"))
        emit(rows, a.json)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
