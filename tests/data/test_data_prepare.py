"""prepare(): every format read, tokenized once, cached by what the output depends on."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data_cases import BYTE_EOS, BYTE_VOCAB, byte_tokenizer, sentence, text_corpus, word_tokenizer, write_jsonl
from ndweave.data import Shards, prepare


def _documents(shards: Shards) -> list[list[int]]:
    return [shards.document(i).tolist() for i in range(shards.num_documents)]


def test_prepare_writes_each_document_with_eos_in_the_sources_order(tmp_path):
    sources = text_corpus(tmp_path / "src", num_documents=5)
    shards = prepare(sources, byte_tokenizer, tmp_path / "out", eos_id=BYTE_EOS, vocab_size=BYTE_VOCAB)
    texts = [(sources / "a_book.txt").read_text()]  # one document per .txt file by default
    texts += [json.loads(line)["text"] for line in (sources / "b_docs.jsonl").read_text().splitlines()]
    assert _documents(shards) == [list(t.encode()) + [BYTE_EOS] for t in texts]
    assert shards.dtype == np.uint16 and shards.lengths.dtype == np.int64 and not shards.has_loss_mask


def test_prepare_txt_paragraphs_parquet_and_uint32(tmp_path):
    (tmp_path / "p.txt").write_text("one two\nthree\n\n\nfour five\n")
    shards = prepare(tmp_path / "p.txt", byte_tokenizer, tmp_path / "out", txt_documents="paragraph")
    assert _documents(shards) == [list(b"one two\nthree"), list(b"four five")]
    assert shards.dtype == np.uint32  # a plain function and no vocab_size: ids may need 32 bits

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["ab", "cde"], "n": [1, 2]}), tmp_path / "rows.parquet")
    shards = prepare(tmp_path / "rows.parquet", byte_tokenizer, tmp_path / "out", text_field="body",
                     eos_id=70000, vocab_size=70001)
    assert _documents(shards) == [[97, 98, 70000], [99, 100, 101, 70000]] and shards.dtype == np.uint32


def test_a_datasets_save_to_disk_folder_reads_as_its_rows(tmp_path):
    """A ``datasets`` dataset saved with ``save_to_disk`` (several arrow files, chats and text), read in its
    row order with pyarrow; a ``DatasetDict``'s folder is refused naming its splits."""
    datasets = pytest.importorskip("datasets")
    texts = [f"row {i}" for i in range(7)]
    datasets.Dataset.from_dict({"text": texts, "n": list(range(7))}).save_to_disk(tmp_path / "saved", num_shards=3)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) == 3
    shards = prepare(tmp_path / "saved", byte_tokenizer, tmp_path / "out", eos_id=BYTE_EOS, vocab_size=BYTE_VOCAB)
    assert _documents(shards) == [list(t.encode()) + [BYTE_EOS] for t in texts]

    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    splits = datasets.DatasetDict(train=datasets.Dataset.from_dict({"messages": chats}),
                                  test=datasets.Dataset.from_dict({"messages": chats}))
    splits.save_to_disk(tmp_path / "dict")
    with pytest.raises(ValueError, match=r"DatasetDict of splits train, test: pass one split's folder .*dict/train"):
        prepare(tmp_path / "dict", byte_tokenizer, tmp_path / "out")
    shards = prepare(tmp_path / "dict" / "train", byte_tokenizer, tmp_path / "out", vocab_size=BYTE_VOCAB,
                     chat_template="default")
    assert shards.num_documents == 1 and shards.has_loss_mask


def test_prepare_with_a_hf_tokenizer_is_the_same_for_any_worker_count(tmp_path):
    tokenizer = word_tokenizer()
    sources = text_corpus(tmp_path / "src")
    one = prepare(sources, tokenizer, tmp_path / "one", eos_id=tokenizer.token_to_id("<eos>"), documents_per_task=7)
    two = prepare(sources, tokenizer, tmp_path / "two", eos_id=tokenizer.token_to_id("<eos>"), documents_per_task=7,
                  workers=2)
    assert one.path.name == two.path.name  # the worker count is not part of what the output depends on
    for name in ("tokens-00000.bin", "documents.npy"):
        assert (one.path / name).read_bytes() == (two.path / name).read_bytes()
    assert _documents(one)[1][:3] == tokenizer.encode(sentence(0, 3), add_special_tokens=False).ids[:3]


def test_prepare_is_cached_and_redone_when_the_data_or_settings_change(tmp_path):
    sources = text_corpus(tmp_path / "src")
    calls = []
    first = prepare(sources, byte_tokenizer, tmp_path / "out", eos_id=BYTE_EOS, vocab_size=BYTE_VOCAB,
                    progress=lambda documents, tokens: calls.append(documents))
    assert calls and calls[-1] == first.num_documents
    calls.clear()
    again = prepare(sources, byte_tokenizer, tmp_path / "out", eos_id=BYTE_EOS, vocab_size=BYTE_VOCAB,
                    progress=lambda documents, tokens: calls.append(documents))
    assert again.path == first.path and calls == []  # reused, nothing tokenized

    other_eos = prepare(sources, byte_tokenizer, tmp_path / "out", eos_id=0, vocab_size=BYTE_VOCAB)
    assert other_eos.path != first.path

    with (sources / "b_docs.jsonl").open("a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    changed = prepare(sources, byte_tokenizer, tmp_path / "out", eos_id=BYTE_EOS, vocab_size=BYTE_VOCAB)
    assert changed.path != first.path and changed.num_documents == first.num_documents + 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.path.name for p in (first, other_eos, changed))  # no partial folders left behind


def test_an_interrupted_prepare_is_redone_never_read(tmp_path):
    sources = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}, {"text": "de"}])
    shards = prepare(sources, byte_tokenizer, tmp_path / "out")
    (shards.path / "manifest.json").unlink()  # as if the process died before writing it
    with pytest.raises(ValueError, match="holds no manifest.json"):
        Shards(shards.path)
    again = prepare(sources, byte_tokenizer, tmp_path / "out")
    assert again.path == shards.path and _documents(again) == [[97, 98, 99], [100, 101]]


def test_shards_reopen_in_other_processes_without_copying_the_tokens(tmp_path):
    import pickle

    shards = prepare(write_jsonl(tmp_path / "d.jsonl", [{"text": "x" * 5000}]), byte_tokenizer, tmp_path / "out")
    shards.document(0)  # opens the memmaps
    assert len(pickle.dumps(shards)) < 2000 and pickle.loads(pickle.dumps(shards)).document(0)[:2].tolist() == [120, 120]
    assert os.path.getsize(shards.path / "tokens-00000.bin") == 5000 * 4
