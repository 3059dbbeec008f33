"""PackedDataset: the four packings, the document mask, determinism from the seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_cases import byte_tokenizer, write_jsonl
from ndweave.data import PackedDataset, document_mask, prepare

EOS = 0


@pytest.fixture
def shards(tmp_path):
    # documents of 3..12 distinct-looking tokens (bytes 'a'.. plus EOS=0), easy to follow by eye
    rows = [{"text": chr(97 + i % 26) * (2 + (i * 7) % 11)} for i in range(30)]
    return prepare(write_jsonl(tmp_path / "d.jsonl", rows), byte_tokenizer, tmp_path / "out", eos_id=EOS,
                   vocab_size=256)


def _stream(shards) -> np.ndarray:
    return np.concatenate([shards.document(i) for i in range(shards.num_documents)]).astype(np.int64)


def test_concat_cuts_the_concatenated_documents_into_windows(shards):
    data = PackedDataset(shards, 16, packing="concat", shuffle=False)
    stream = _stream(shards)
    assert len(data) == (stream.size - 1) // 16
    for k in (0, 1, len(data) - 1):
        sample = data[k]
        assert sample["input_ids"].tolist() == stream[k * 16:(k + 1) * 16].tolist()
        assert sample["targets"].tolist() == stream[k * 16 + 1:(k + 1) * 16 + 1].tolist()
        assert sample["loss_mask"].all() and (sample["document_ids"] == 0).all()
        assert sample["position_ids"].tolist() == list(range(16))
    assert torch.equal(data[len(data)]["input_ids"], data[0]["input_ids"])  # epoch 1, unshuffled


def test_documents_restart_positions_mask_boundaries_and_give_a_block_diagonal_mask(shards):
    data = PackedDataset(shards, 24, packing="documents", shuffle=False)
    stream = _stream(shards)
    sample = data[2]
    ids = sample["input_ids"]
    assert ids.tolist() == stream[48:72].tolist()
    doc, pos, mask = sample["document_ids"], sample["position_ids"], sample["loss_mask"]
    assert doc.max() >= 2  # the window holds several documents
    for i in range(24):
        starts = i == 0 or doc[i] != doc[i - 1]
        assert pos[i] == (0 if starts else pos[i - 1] + 1)
        if starts and i:
            assert ids[i - 1] == EOS  # a document starts after the previous one's EOS
        crosses = i < 23 and doc[i + 1] != doc[i] or i == 23 and ids[i] == EOS
        assert mask[i] == (not crosses), i  # the target that is the next document's first token is masked
    attend = document_mask(doc.unsqueeze(0))
    assert attend.shape == (1, 1, 24, 24) and attend.dtype == torch.bool
    expected = (doc[:, None] == doc[None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()
    assert torch.equal(attend[0, 0], expected)
    # blocks: tokens of one document see each other causally, and nothing of another
    first = (doc == doc[0]).sum()
    assert attend[0, 0, first, :first].sum() == 0 and attend[0, 0, first, first]


def test_first_fit_packs_whole_documents_and_none_one_each(shards):
    lengths = shards.lengths
    for packing in ("first_fit", "none"):
        data = PackedDataset(shards, 16, packing=packing, seed=3)
        seen = []
        for k in range(len(data)):
            sample = data[k]
            doc, ids = sample["document_ids"], torch.cat([sample["input_ids"], sample["targets"][-1:]])
            full = torch.cat([doc, doc[-1:]])
            for d in range(int(doc.max()) + 1):
                piece = ids[full == d]
                # whole documents only: each segment starts with a letter run and ends with EOS
                assert piece[-1] == EOS and (piece[:-1] == piece[0]).all() and piece[0] != EOS
                seen.append(piece.numel())
            pad = doc == -1
            assert not sample["loss_mask"][pad].any() and (sample["input_ids"][pad] == 0).all()
            if packing == "none":
                assert doc.max() == 0
        assert sorted(seen) == sorted(lengths[lengths <= 17].tolist())
        assert data.num_dropped == int((lengths > 17).sum())
    first_fit, none = PackedDataset(shards, 16, packing="first_fit"), PackedDataset(shards, 16, packing="none")
    assert len(first_fit) < len(none)


def test_truncate_cuts_long_documents(shards):
    data = PackedDataset(shards, 4, packing="none", truncate=True, shuffle=False)
    assert len(data) == shards.num_documents and data.num_dropped == 0
    long = int(np.flatnonzero(shards.lengths > 5)[0])
    sample = data[long]
    assert sample["input_ids"].tolist() == shards.document(long)[:4].tolist()
    assert sample["targets"][-1] == shards.document(long)[4] and sample["loss_mask"].all()


def test_samples_are_a_function_of_the_seed_and_index(shards):
    a, b = (PackedDataset(shards, 8, packing="documents", seed=5) for _ in range(2))
    other = PackedDataset(shards, 8, packing="documents", seed=6)
    ks = [0, 3, 11, len(a) + 2, 5 * len(a) + 1]
    for k in reversed(ks):  # any order of access
        assert all(torch.equal(a[k][f], b[k][f]) for f in a[k])
    assert any(not torch.equal(a[k]["input_ids"], other[k]["input_ids"]) for k in ks)
    # unshuffled, the order is the sources'
    plain = PackedDataset(shards, 8, packing="documents", shuffle=False)
    assert plain[0]["input_ids"].tolist() == _stream(shards)[:8].tolist()
