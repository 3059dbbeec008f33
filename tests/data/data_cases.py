"""Tiny corpora and tokenizers the data tests share, written into each test's tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ("the cat sat on a mat while one dog ran far away and every bird sang loud songs "
         "at dawn so we wrote small notes about it").split()

#: byte tokens 0..255 and the end-of-document token
BYTE_EOS = 256
BYTE_VOCAB = 257


def byte_tokenizer(text: str) -> list[int]:
    """A plain function tokenizer (module-level: it reaches prepare's spawned workers)."""
    return list(text.encode())


def sentence(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def text_corpus(folder: Path, num_documents: int = 40, seed_shift: int = 0) -> Path:
    """A folder of a .txt file (one document) and a .jsonl file of documents of varied lengths."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a_book.txt").write_text(sentence(seed_shift, 30) + "\n\n" + sentence(seed_shift + 1, 12) + "\n")
    write_jsonl(folder / "b_docs.jsonl",
                [{"text": sentence(i + seed_shift, 3 + (i * 5) % 17), "id": i} for i in range(num_documents)])
    return folder


def chats(num: int = 12) -> list[dict]:
    """Chat records of one to three exchanges, some with a system message."""
    rows = []
    for i in range(num):
        messages = [{"role": "system", "content": sentence(i, 3)}] if i % 3 == 0 else []
        for turn in range(1 + i % 3):
            messages.append({"role": "user", "content": sentence(i + turn, 2 + turn)})
            messages.append({"role": "assistant", "content": sentence(i + turn + 5, 3 + i % 4)})
        rows.append({"messages": messages})
    return rows


def word_tokenizer():
    """A WordLevel tokenizer trained on the fly: the corpus' words, the chat markers' pieces, EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"])
    markers = "<|system|> <|user|> <|assistant|> <|end|>"
    tokenizer.train_from_iterator([" ".join(WORDS), markers], trainer=trainer)
    return tokenizer
