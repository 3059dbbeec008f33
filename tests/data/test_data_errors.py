"""Bad input: one clear ValueError naming the file, record or field, and the fix."""

from __future__ import annotations

import json

import pytest

from data_cases import BYTE_EOS, BYTE_VOCAB, byte_tokenizer, chats, write_jsonl
from ndweave.data import PackedDataset, Shards, prepare


def _prepare(source, tmp_path, **kwargs):
    return prepare(source, byte_tokenizer, tmp_path / "out", **kwargs)


def test_a_record_without_the_text_field(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"content": "no text here"}])
    with pytest.raises(ValueError, match=r"d\.jsonl line 2: no 'text' field \(its fields: content\); pass text_field="):
        _prepare(source, tmp_path)
    assert _prepare(write_jsonl(tmp_path / "e.jsonl", [{"content": "x"}]), tmp_path, text_field="content").num_documents == 1


def test_empty_and_unreadable_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty: fill it or remove it"):
        _prepare(tmp_path / "empty.txt", tmp_path)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2 is not valid JSON"):
        _prepare(tmp_path / "bad.jsonl", tmp_path)
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"latin\.txt is not UTF-8 text .*re-encode it"):
        _prepare(tmp_path / "latin.txt", tmp_path)
    with pytest.raises(ValueError, match=r"missing\.jsonl does not exist"):
        _prepare(tmp_path / "missing.jsonl", tmp_path)
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"table\.csv: unsupported file type '\.csv'"):
        _prepare(tmp_path / "table.csv", tmp_path)


def test_a_truncated_shard(tmp_path):
    shards = _prepare(write_jsonl(tmp_path / "d.jsonl", [{"text": "abcdef"}]), tmp_path, eos_id=BYTE_EOS,
                      vocab_size=BYTE_VOCAB)
    tokens = shards.path / "tokens-00000.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"tokens-00000\.bin holds 12 bytes but the index expects 14 bytes: it is "
                                         r"truncated or corrupt; delete the folder and run prepare\(\) again"):
        Shards(shards.path)


def test_token_ids_outside_the_vocabulary(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": "ABC"}, {"text": "abc"}])
    with pytest.raises(ValueError, match=r"d\.jsonl line 2: token id 99 lies outside the vocabulary of 98 ids"):
        _prepare(source, tmp_path, vocab_size=98)
    with pytest.raises(ValueError, match="eos_id 300 lies outside the vocabulary of 257"):
        _prepare(source, tmp_path, vocab_size=BYTE_VOCAB, eos_id=300)


def test_a_chat_without_a_template(tmp_path):
    source = write_jsonl(tmp_path / "chat.jsonl", chats(2))
    with pytest.raises(ValueError, match=r"chat\.jsonl line 1 is a chat \('messages'\) but the tokenizer \(byte_tokenizer\) "
                                         r"has no chat template: pass chat_template='default'"):
        _prepare(source, tmp_path)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl line 1: message 0 must be an object with string 'role' and 'content'"):
        _prepare(bad, tmp_path, chat_template="default")


def test_every_document_longer_than_the_block_with_packing_none(tmp_path):
    shards = _prepare(write_jsonl(tmp_path / "d.jsonl", [{"text": "abcdefgh"}, {"text": "abcdefghij"}]), tmp_path)
    with pytest.raises(ValueError, match=r"every document is longer than block_size \+ 1 = 5 tokens \(the shortest has 8\)"
                                         r".*truncate=True"):
        PackedDataset(shards, 4, packing="none")
    with pytest.raises(ValueError, match="packing='pack': use one of"):
        PackedDataset(shards, 4, packing="pack")
    with pytest.raises(ValueError, match="fewer than one sample"):
        PackedDataset(shards, 100, packing="concat")


def test_a_parquet_file_without_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match=r"rows\.parquet: no 'text' column \(its columns: body\); pass text_field="):
        _prepare(tmp_path / "rows.parquet", tmp_path)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken\.parquet is not a readable parquet file"):
        _prepare(tmp_path / "broken.parquet", tmp_path)
