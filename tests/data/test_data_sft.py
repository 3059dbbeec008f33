"""SFT: chats rendered with a template, the loss on the assistant's tokens only, packed first-fit."""

from __future__ import annotations

import pytest

from data_cases import chats, word_tokenizer, write_jsonl
from ndweave.data import PackedDataset, prepare

#: a Jinja template in the style of HF models', with the same markers as ndweave's default
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _expected_trained(record: dict, tokenizer) -> list[str]:
    """The tokens a chat trains on: each assistant message's content and end marker, and the EOS
    when the assistant has the last word."""
    trained = []
    for message in record["messages"]:
        if message["role"] == "assistant":
            trained += message["content"].split() + ["<|", "end", "|>"]
    return trained + (["<eos>"] if record["messages"][-1]["role"] == "assistant" else [])


def _check_masks(shards, records, tokenizer):
    assert shards.has_loss_mask and shards.num_documents == len(records)
    for i, record in enumerate(records):
        ids, mask = shards.document(i).tolist(), shards.loss_mask(i).astype(bool).tolist()
        tokens = [tokenizer.id_to_token(t) for t in ids]
        assert [t for t, m in zip(tokens, mask) if m] == _expected_trained(record, tokenizer)
        assert tokens[:3] == ["<|", record["messages"][0]["role"], "|>"] and not any(mask[:3])


def test_default_template_trains_on_exactly_the_assistant_tokens(tmp_path):
    tokenizer, records = word_tokenizer(), chats(9)
    records[4]["messages"].append({"role": "user", "content": "the end"})  # the user has the last word
    shards = prepare(write_jsonl(tmp_path / "chat.jsonl", records), tokenizer, tmp_path / "out",
                     chat_template="default", eos_id=tokenizer.token_to_id("<eos>"))
    _check_masks(shards, records, tokenizer)


def test_a_transformers_chat_template_trains_on_exactly_the_assistant_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    backend = word_tokenizer()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=TEMPLATE)
    records = chats(6)
    shards = prepare(write_jsonl(tmp_path / "chat.jsonl", records), tokenizer, tmp_path / "out",
                     eos_id=backend.token_to_id("<eos>"))
    _check_masks(shards, records, backend)
    # the sequence rendered message by message (for the masks) is the tokenizer's own rendering, whole
    for i, record in enumerate(records):
        whole = tokenizer.apply_chat_template(record["messages"], tokenize=False)
        assert shards.document(i).tolist() == [*tokenizer.encode(whole, add_special_tokens=False),
                                               backend.token_to_id("<eos>")]


def test_sft_packs_whole_chats_first_fit_and_keeps_their_masks(tmp_path):
    tokenizer = word_tokenizer()
    records = chats(20)
    # plain text mixed in: trained on throughout
    (tmp_path / "src").mkdir()
    write_jsonl(tmp_path / "src" / "a.jsonl", records[:10])
    write_jsonl(tmp_path / "src" / "b.jsonl", [{"text": "the cat sat"}] + records[10:])
    shards = prepare(tmp_path / "src", tokenizer, tmp_path / "out", chat_template="default",
                     eos_id=tokenizer.token_to_id("<eos>"))
    assert shards.loss_mask(10).all() and not shards.loss_mask(0).all()
    data = PackedDataset(shards, 64, packing="first_fit", seed=0)
    assert data.num_dropped == 0 and len(data) < shards.num_documents
    trained = sum(int(data[k]["loss_mask"].sum()) for k in range(len(data)))
    # every trained token of every document is a target once (a document's first token never is:
    # it starts a segment)
    assert trained == sum(int(shards.loss_mask(i)[1:].sum()) for i in range(shards.num_documents))
