"""Reading local text data as documents: ``.txt``, ``.jsonl``, ``.parquet``, or folders of them.

- ``.txt``: one document per file (``txt_documents="file"``, the default: a book, a source file), or
  one per paragraph, paragraphs being separated by blank lines (``txt_documents="paragraph"``).
- ``.jsonl``: one record per line; its text under ``text_field`` (``"text"``), or a chat under
  ``messages`` (a list of ``{"role", "content"}``), which takes precedence.
- ``.parquet``: one record per row, the same fields (needs ``pyarrow``).
- A ``datasets`` dataset saved with ``save_to_disk`` (a folder with ``state.json``): its rows, in its
  ``.arrow`` files' order, the same fields (read with ``pyarrow``; ``datasets`` itself is not needed).
  A ``DatasetDict``'s folder names its splits: pass the split's folder (``saved/train``).

A folder stands for its files of these kinds, found recursively in sorted path order (hidden files
left out), so the order of documents, hence of the prepared data, depends on the names only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Record", "SUFFIXES", "data_files", "read_records"]

SUFFIXES = (".txt", ".jsonl", ".parquet")
#: what ``save_to_disk`` writes: the arrow files ``state.json`` lists
SAVED_DATASET = "state.json"


@dataclass(frozen=True)
class Record:
    """One document as read: its text, or a chat's messages."""

    where: str
    """The file and line/row, for error messages."""

    text: str | None = None
    """The plain text (``None`` for a chat)."""

    messages: list | None = None
    """A chat's messages (``None`` for plain text)."""


def data_files(sources: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """The files ``sources`` stand for (each a file or a folder), in order, with a clear error for a
    path that does not exist or has no supported suffix."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise ValueError(f"{path} is a saved DatasetDict of splits {', '.join(splits)}: pass one split's folder "
                             f"({path / (splits[0] if splits else 'train')})")
        if (path / SAVED_DATASET).is_file():
            files += _saved_dataset(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise ValueError(f"{path} holds no {', '.join(SUFFIXES)} files: point at the data files or their folder")
            files += found
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(f"{path}: unsupported file type {path.suffix!r}; convert it to one of {', '.join(SUFFIXES)}")
            files.append(path)
        else:
            raise ValueError(f"{path} does not exist: check the path given to prepare()")
    if not files:
        raise ValueError("no data sources given to prepare()")
    return files


def _saved_dataset(folder: Path) -> list[Path]:
    """The ``.arrow`` files of a ``save_to_disk`` folder, in the dataset's row order."""
    try:
        listed = [entry["filename"] for entry in json.loads((folder / SAVED_DATASET).read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{folder / SAVED_DATASET} is not a datasets save_to_disk state: save it again "
                         "(Dataset.save_to_disk)") from None
    files = [folder / name for name in listed]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ValueError(f"{folder}: the saved dataset's files {', '.join(missing) or '(none listed)'} are missing: "
                         "save it again (Dataset.save_to_disk)")
    return files


def read_records(path: Path, *, text_field: str = "text", txt_documents: str = "file") -> Iterator[Record]:
    """The documents of one file, in order (``ValueError`` naming the file and line for bad input)."""
    try:
        if path.stat().st_size == 0:
            raise ValueError(f"{path} is empty: fill it or remove it from the sources")
        if path.suffix == ".txt":
            yield from _txt(path, txt_documents)
        elif path.suffix == ".jsonl":
            yield from _jsonl(path, text_field)
        elif path.suffix == ".arrow":
            yield from _arrow(path, text_field)
        else:
            yield from _parquet(path, text_field)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): re-encode it as UTF-8") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}): check its permissions") from None


def _txt(path: Path, txt_documents: str) -> Iterator[Record]:
    text = path.read_text(encoding="utf-8")
    if txt_documents == "file":
        if text.strip():
            yield Record(str(path), text=text)
            return
    elif txt_documents == "paragraph":
        found = False
        for i, paragraph in enumerate(p for p in _paragraphs(text)):
            found = True
            yield Record(f"{path} paragraph {i + 1}", text=paragraph)
        if found:
            return
    else:
        raise ValueError(f"txt_documents={txt_documents!r}: use 'file' (one document per file) or 'paragraph'")
    raise ValueError(f"{path} holds only whitespace: fill it or remove it from the sources")


def _paragraphs(text: str) -> Iterator[str]:
    paragraph: list[str] = []
    for line in text.splitlines():
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "\n".join(paragraph)
            paragraph = []
    if paragraph:
        yield "\n".join(paragraph)


def _record(row: object, where: str, text_field: str) -> Record:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a record must be a JSON object with a {text_field!r} or 'messages' field, "
                         f"got {type(row).__name__}")
    if row.get("messages") is not None:
        return Record(where, messages=row["messages"])
    if text_field not in row:
        raise ValueError(f"{where}: no {text_field!r} field (its fields: {', '.join(map(str, row)) or 'none'}); "
                         f"pass text_field= naming the field that holds the text, or give chat records a 'messages' field")
    text = row[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} holds {type(text).__name__}, not text: fix the record")
    return Record(where, text=text)


def _jsonl(path: Path, text_field: str) -> Iterator[Record]:
    found = False
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not valid JSON ({e.msg}): fix or remove the line") from None
            found = True
            yield _record(row, f"{path} line {number}", text_field)
    if not found:
        raise ValueError(f"{path} holds no records (only blank lines): fill it or remove it from the sources")


def _pyarrow(path: Path):
    try:
        import pyarrow
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow (or ndweave-data[parquet])") from None
    return pyarrow


def _columns(path: Path, names: list[str], text_field: str) -> list[str]:
    """The columns holding the records: a chat's ``messages``, else ``text_field``."""
    if "messages" in names:
        return ["messages"]
    if text_field in names:
        return [text_field]
    raise ValueError(f"{path}: no {text_field!r} column (its columns: {', '.join(names)}); pass text_field= "
                     "naming the column that holds the text, or give chat rows a 'messages' column")


def _rows(path: Path, batches: Iterable, text_field: str) -> Iterator[Record]:
    row_number = 0
    for batch in batches:
        for row in batch.to_pylist():
            row_number += 1
            yield _record(row, f"{path} row {row_number}", text_field)
    if not row_number:
        raise ValueError(f"{path} holds no rows: fill it or remove it from the sources")


def _parquet(path: Path, text_field: str) -> Iterator[Record]:
    _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own error types: a truncated or non-parquet file
        raise ValueError(f"{path} is not a readable parquet file ({e}): rewrite or remove it") from None
    columns = _columns(path, table.schema_arrow.names, text_field)
    yield from _rows(path, table.iter_batches(columns=columns), text_field)


def _arrow(path: Path, text_field: str) -> Iterator[Record]:
    """A ``save_to_disk`` data file: an Arrow IPC stream (``datasets`` writes streams, not IPC files)."""
    pa = _pyarrow(path)
    try:
        stream = pa.ipc.open_stream(pa.memory_map(str(path)))
        batches = list(stream)
    except Exception as e:  # pyarrow's own error types: a truncated or foreign file
        raise ValueError(f"{path} is not a readable arrow stream ({e}): save the dataset again") from None
    columns = _columns(path, stream.schema.names, text_field)
    yield from _rows(path, (b.select(columns) for b in batches), text_field)
