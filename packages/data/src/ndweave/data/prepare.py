"""Tokenize once: local text data → token shards, cached under a hash of what they depend on.

``prepare(sources, tokenizer, out_dir)`` reads the sources' documents (see ``sources``), tokenizes
them in worker processes, appends the end-of-document token, and writes the shards ``Shards`` reads.
The folder's name is a hash of the data files (path, size, modification time), the tokenizer
(``TextTokenizer.fingerprint``) and the settings: a second call with the same inputs returns the
folder as it is, a touched file or another tokenizer prepares anew beside it. The folder is written
under a temporary name, its manifest last, then renamed: an interrupted prepare leaves no folder
that could be read half-written, and two processes preparing the same data at once (every rank of
a job) end with one folder.

The output is the same whatever the number of workers: the main process reads the documents in
order and hands them out in batches; the workers' results come back in that order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ndweave.data.chat import tokenize_chat
from ndweave.data.shards import MANIFEST, Shards
from ndweave.data.sources import Record, data_files, read_records
from ndweave.data.tokenizer import TextTokenizer

__all__ = ["prepare"]

#: bump when the on-disk layout changes: older folders are then prepared anew
FORMAT_VERSION = 1


@dataclass(frozen=True)
class _Settings:
    """What the tokenized output depends on besides the files and the tokenizer (the cache key)."""

    eos_id: int | None
    vocab_size: int | None
    text_field: str
    txt_documents: str
    chat_template: str | None
    max_shard_tokens: int


def prepare(sources: str | os.PathLike | Iterable[str | os.PathLike], tokenizer: Any, out_dir: str | os.PathLike, *,
            eos_id: int | None = None, vocab_size: int | None = None, text_field: str = "text",
            txt_documents: str = "file", chat_template: str | None = None, workers: int = 1,
            documents_per_task: int = 256, max_shard_tokens: int = 1 << 28, tokenizer_name: str | None = None,
            progress: Callable[[int, int], None] | bool | None = None) -> Shards:
    """Tokenize ``sources`` once into ``out_dir/<hash>/`` and return the prepared :class:`Shards`.

    Args:
        sources: a file or folder, or several (``.txt``, ``.jsonl``, ``.parquet``; see ``sources``).
        tokenizer: a ``tokenizers.Tokenizer``, a ``transformers`` tokenizer or a function
            ``text -> list[int]``.
        out_dir: where prepared folders are kept (one per distinct input).
        eos_id: appended to every document (``None``: nothing appended; then documents run into each
            other with no separator under ``packing="concat"``).
        vocab_size: ids must lie below it (default: the tokenizer's own); it picks ``uint16`` shards
            when ``<= 65536``, else ``uint32`` (also when unknown).
        text_field: the field of a ``.jsonl`` record or ``.parquet`` row that holds the text.
        txt_documents: ``"file"`` (a ``.txt`` file is one document) or ``"paragraph"`` (blank-line
            separated paragraphs are).
        chat_template: for chat records: ``None`` (the tokenizer's own), ``"default"`` (ndweave's,
            see ``chat``), or a Jinja template string (with a ``transformers`` tokenizer).
        workers: tokenizing processes (1: in this process), forked on Linux (spawned elsewhere: the
            tokenizer must then pickle); the output does not depend on their number.
        documents_per_task: documents handed to a worker at a time.
        max_shard_tokens: tokens per shard file at most (a document never spans two).
        tokenizer_name: names the tokenizer in the cache key instead of its hash (``TextTokenizer``).
        progress: ``progress(documents_done, tokens_done)`` after each task; ``True`` shows a tqdm bar
            when tqdm is installed.
    """
    files = data_files(sources)
    text_tokenizer = TextTokenizer(tokenizer, vocab_size=vocab_size, name=tokenizer_name)
    settings = _Settings(eos_id, text_tokenizer.vocab_size, text_field, txt_documents, chat_template, max_shard_tokens)
    if eos_id is not None and settings.vocab_size is not None and not 0 <= eos_id < settings.vocab_size:
        raise ValueError(f"eos_id {eos_id} lies outside the vocabulary of {settings.vocab_size} tokens: pass the tokenizer's "
                         "end-of-text id")
    out_dir = Path(out_dir)
    final = out_dir / _cache_key(files, text_tokenizer, settings)
    if (final / MANIFEST).is_file():
        return Shards(final)
    if final.exists():  # an interrupted prepare of an older version that wrote in place
        shutil.rmtree(final)
    out_dir.mkdir(parents=True, exist_ok=True)
    temporary = out_dir / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        with _progress(progress) as update:
            _write(files, text_tokenizer, settings, temporary, workers, documents_per_task, update)
        try:
            os.rename(temporary, final)
        except OSError:
            if not (final / MANIFEST).is_file():  # not another process having finished first
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return Shards(final)


def _cache_key(files: list[Path], tokenizer: TextTokenizer, settings: _Settings) -> str:
    stats = []
    for path in files:
        stat = path.stat()
        stats.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    key = json.dumps({"format": FORMAT_VERSION, "files": stats, "tokenizer": tokenizer.fingerprint(),
                      "settings": settings.__dict__}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:20]


@contextlib.contextmanager
def _progress(progress: Callable[[int, int], None] | bool | None) -> Iterator[Callable[[int, int], None] | None]:
    """The ``progress`` callback; ``True``: a tqdm bar of documents and tokens, closed (and left showing
    the totals) when the shards are written."""
    if progress is not True:
        yield progress or None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    bar = tqdm(unit=" documents", desc="prepare", delay=0.5)  # a cached or quick prepare shows nothing

    def update(documents: int, tokens: int) -> None:
        bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
        bar.update(documents - bar.n)

    try:
        yield update
    finally:
        bar.close()


def _tasks(files: list[Path], settings: _Settings, size: int) -> Iterator[list[Record]]:
    task: list[Record] = []
    for path in files:
        for record in read_records(path, text_field=settings.text_field, txt_documents=settings.txt_documents):
            task.append(record)
            if len(task) == size:
                yield task
                task = []
    if task:
        yield task


#: a worker's tokenizer and settings, set once per process by ``_init_worker`` (not sent with each task)
_WORKER: tuple[TextTokenizer, _Settings] | None = None


def _init_worker(tokenizer: TextTokenizer, settings: _Settings) -> None:
    global _WORKER
    _WORKER = (tokenizer, settings)


def _tokenize_task(task: list[Record]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return _tokenize(task, *_WORKER)


def _tokenize(task: list[Record], tokenizer: TextTokenizer,
              settings: _Settings) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A task's documents as (lengths, concatenated ids as int64, concatenated masks or ``None``)."""
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    any_mask = False
    limit = settings.vocab_size if settings.vocab_size is not None else 1 << 32
    texts = iter(tokenizer.encode_batch([r.text for r in task if r.messages is None]))  # plain text: one call
    for record in task:
        if record.messages is not None:
            tokens, mask = tokenize_chat(record.messages, tokenizer, chat_template=settings.chat_template,
                                         where=record.where)
            trains_eos = record.messages[-1]["role"] == "assistant"
            any_mask = True
        else:
            tokens, mask, trains_eos = next(texts), None, True
        if settings.eos_id is not None:
            tokens = [*tokens, settings.eos_id]
            mask = None if mask is None else [*mask, trains_eos]
        array = np.asarray(tokens, dtype=np.int64)
        if array.size and (array.max() >= limit or array.min() < 0):
            bad = int(array.max()) if array.max() >= limit else int(array.min())
            raise ValueError(f"{record.where}: token id {bad} lies outside the vocabulary of {limit} ids: the tokenizer and "
                             "vocab_size disagree; pass the tokenizer's vocabulary size as vocab_size")
        ids.append(array)
        masks.append(np.ones(array.size, np.uint8) if mask is None else np.asarray(mask, np.uint8))
    lengths = np.asarray([a.size for a in ids], np.int64)
    return lengths, np.concatenate(ids), np.concatenate(masks) if any_mask else None


class _ShardWriter:
    """Appends documents to shard files, starting a new one at ``max_shard_tokens``."""

    def __init__(self, folder: Path, dtype: np.dtype, max_shard_tokens: int) -> None:
        self.folder, self.dtype, self.max_shard_tokens = folder, dtype, max_shard_tokens
        self.shard_tokens: list[int] = []
        self.index: list[tuple[int, int, int]] = []
        self.has_mask = False
        self._tokens_file = self._mask_file = None

    def _name(self, kind: str, shard: int) -> Path:
        return self.folder / f"{kind}-{shard:05d}.bin"

    def _new_shard(self) -> None:
        self.close()
        self.shard_tokens.append(0)
        self._tokens_file = self._name("tokens", len(self.shard_tokens) - 1).open("ab")
        if self.has_mask:
            self._mask_file = self._name("mask", len(self.shard_tokens) - 1).open("ab")

    def add(self, lengths: np.ndarray, ids: np.ndarray, masks: np.ndarray | None) -> None:
        if masks is not None and not self.has_mask:
            # the first chat: every token written before it was plain text, trained on
            self.has_mask = True
            for shard, count in enumerate(self.shard_tokens):
                self._name("mask", shard).write_bytes(np.ones(count, np.uint8).tobytes())
            if self._tokens_file is not None:
                self._mask_file = self._name("mask", len(self.shard_tokens) - 1).open("ab")
        offset = 0
        for length in lengths.tolist():
            piece = slice(offset, offset + length)
            offset += length
            if length == 0:  # an empty text with no end-of-document token: nothing to train on
                continue
            if self._tokens_file is None or (self.shard_tokens[-1] and self.shard_tokens[-1] + length > self.max_shard_tokens):
                self._new_shard()
            self._tokens_file.write(ids[piece].astype(self.dtype).tobytes())
            if self.has_mask:
                self._mask_file.write((masks[piece] if masks is not None else np.ones(length, np.uint8)).tobytes())
            shard = len(self.shard_tokens) - 1
            self.index.append((shard, self.shard_tokens[shard], length))
            self.shard_tokens[shard] += length

    def close(self) -> None:
        for f in (self._tokens_file, self._mask_file):
            if f is not None:
                f.close()
        self._tokens_file = self._mask_file = None


def _write(files: list[Path], tokenizer: TextTokenizer, settings: _Settings, folder: Path, workers: int,
           documents_per_task: int, progress: Callable[[int, int], None] | None) -> None:
    dtype = np.dtype(np.uint16 if settings.vocab_size is not None and settings.vocab_size <= 1 << 16 else np.uint32)
    writer = _ShardWriter(folder, dtype, settings.max_shard_tokens)
    tasks = _tasks(files, settings, documents_per_task)
    documents = tokens = 0
    pool = None
    if workers > 1:
        # forked where the platform can (as DataLoader workers are): no `if __name__ == "__main__"` needed
        # in the user's script, and any tokenizer works; the children run numpy and the tokenizer only
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        pool = multiprocessing.get_context(method).Pool(workers, _init_worker, (tokenizer, settings))
        results = pool.imap(_tokenize_task, tasks)  # in task order, whatever finishes first
    else:
        results = (_tokenize(task, tokenizer, settings) for task in tasks)
    try:
        for lengths, ids, masks in results:
            writer.add(lengths, ids, masks)
            documents, tokens = documents + lengths.size, tokens + int(lengths.sum())
            if progress is not None:
                progress(documents, tokens)
    finally:
        writer.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    if not writer.index:
        raise ValueError(f"{', '.join(map(str, files))}: no document has any tokens; check the sources and the tokenizer")
    np.save(folder / "documents.npy", np.asarray(writer.index, np.int64))
    shards = [{"tokens": f"tokens-{i:05d}.bin", "num_tokens": n, **({"mask": f"mask-{i:05d}.bin"} if writer.has_mask else {})}
              for i, n in enumerate(writer.shard_tokens)]
    manifest = {"format": FORMAT_VERSION, "dtype": dtype.name, "num_documents": len(writer.index),
                "num_tokens": sum(writer.shard_tokens), "vocab_size": settings.vocab_size, "eos_id": settings.eos_id,
                "loss_mask": writer.has_mask, "shards": shards, "sources": [str(p) for p in files],
                "settings": settings.__dict__}
    # written last: its presence says the folder is complete
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
