"""Exact resume on any mesh: save the stream's state after some global batches, load it into a stream
at another DP size and worker count, and read the same next global batches, bit for bit."""

from __future__ import annotations

import pytest
import torch

from data_cases import BYTE_EOS, BYTE_VOCAB, byte_tokenizer, chats, text_corpus, word_tokenizer, write_jsonl
from ndweave.data import Mixture, PackedDataset, TokenStream, prepare

GLOBAL_BATCH = 8
BLOCK = 16
SAVED_AT, TOTAL = 3, 6  # global batches before the checkpoint, and in all
#: (dp_size, num_workers) of the resumed runs
RESUMED = [(1, 0), (2, 2), (4, 0), (4, 1)]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    web = prepare(text_corpus(root / "web"), byte_tokenizer, root / "out", eos_id=BYTE_EOS, vocab_size=BYTE_VOCAB)
    code = prepare(text_corpus(root / "code", num_documents=25, seed_shift=3), byte_tokenizer, root / "out",
                   eos_id=BYTE_EOS, vocab_size=BYTE_VOCAB)
    tokenizer = word_tokenizer()
    sft = prepare(write_jsonl(root / "chat.jsonl", chats(30)), tokenizer, root / "out", chat_template="default",
                  eos_id=tokenizer.token_to_id("<eos>"))
    return {
        "documents": lambda: PackedDataset(web, BLOCK, packing="documents", seed=1),
        # small chunks: the 48 samples cross several chunks of the mixture and epochs of "code"
        "mixture": lambda: Mixture([(PackedDataset(web, BLOCK, packing="concat", seed=2), 0.7),
                                    (PackedDataset(code, BLOCK, packing="documents", seed=3), 0.3)],
                                   seed=4, chunk_size=10),
        "sft": lambda: PackedDataset(sft, 32, packing="first_fit", seed=5),
    }


def _global_batches(make, num_batches, *, dp_size, num_workers, state=None):
    """The next ``num_batches`` global batches, each the concatenation of every rank's slice (each
    rank a stream of its own, as on a mesh), and the state the ranks end with."""
    streams = [TokenStream(make(), GLOBAL_BATCH, dp_rank=r, dp_size=dp_size, num_workers=num_workers)
               for r in range(dp_size)]
    per_rank = []
    for stream in streams:
        if state is not None:
            stream.load_state_dict(state)
        batches = iter(stream)
        per_rank.append([next(batches) for _ in range(num_batches)])
        batches.close()  # stops the loader's workers
    states = {stream.state_dict()["samples_seen"] for stream in streams}
    assert len(states) == 1, "every rank counts the same global position"
    merged = [{key: torch.cat([rank[b][key] for rank in per_rank]) for key in per_rank[0][b]}
              for b in range(num_batches)]
    return merged, {"samples_seen": states.pop()}


@pytest.mark.parametrize("kind", ["documents", "mixture", "sft"])
def test_resume_reads_the_same_global_batches_at_any_dp_size_and_worker_count(datasets, kind):
    make = datasets[kind]
    uninterrupted, _ = _global_batches(make, TOTAL, dp_size=1, num_workers=0)
    _, state = _global_batches(make, SAVED_AT, dp_size=2, num_workers=0)
    assert state == {"samples_seen": SAVED_AT * GLOBAL_BATCH}
    for dp_size, num_workers in RESUMED:
        resumed, _ = _global_batches(make, TOTAL - SAVED_AT, dp_size=dp_size, num_workers=num_workers, state=state)
        for b, batch in enumerate(resumed):
            expected = uninterrupted[SAVED_AT + b]
            assert batch.keys() == expected.keys()
            for key in batch:
                assert torch.equal(batch[key], expected[key]), (kind, dp_size, num_workers, b, key)
    if kind == "sft":
        assert any(not b["loss_mask"].all() for b in uninterrupted)


def test_state_is_one_small_dict_and_next_batch_agrees_with_the_loader(datasets):
    stream = TokenStream(datasets["documents"](), GLOBAL_BATCH, dp_rank=1, dp_size=2)
    assert list(stream.rank_indices()) == [4, 5, 6, 7]
    first = stream.next_batch()
    assert stream.state_dict() == {"samples_seen": GLOBAL_BATCH} and first["input_ids"].shape == (4, BLOCK)
    loader = TokenStream(datasets["documents"](), GLOBAL_BATCH, dp_rank=1, dp_size=2, num_workers=1)
    batches = iter(loader)
    assert torch.equal(next(batches)["input_ids"], first["input_ids"])
    batches.close()
    with pytest.raises(ValueError, match="does not split over 3"):
        TokenStream(datasets["documents"](), GLOBAL_BATCH, dp_rank=0, dp_size=3)


def test_a_mixture_keeps_its_weights_per_chunk(datasets):
    mixture = datasets["mixture"]()
    sources = [mixture.locate(k)[0] for k in range(100)]
    assert mixture.counts.tolist() == [7, 3] and sources.count(0) == 70
    # each source's samples come in order: the mixture reads every source as a stream of its own
    for s in (0, 1):
        assert [mixture.locate(k)[1] for k in range(100) if sources[k] == s] == list(range(sources.count(s)))


def test_a_changed_global_batch_size_goes_on_at_the_next_sample(datasets):
    stream = TokenStream(datasets["mixture"](), GLOBAL_BATCH)
    for _ in range(3):
        stream.next_batch()
    bigger = TokenStream(datasets["mixture"](), 2 * GLOBAL_BATCH, dp_rank=0, dp_size=2)
    bigger.load_state_dict(stream.state_dict())
    assert list(bigger.rank_indices()) == list(range(24, 32))
    reference = datasets["mixture"]()
    batch = bigger.next_batch()
    assert all(torch.equal(batch["input_ids"][i], reference[24 + i]["input_ids"]) for i in range(8))
