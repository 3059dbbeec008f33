"""Any tokenizer as one picklable callable ``text -> token ids``, with what the cache key needs.

Three kinds are taken as they are: a HF ``tokenizers.Tokenizer``, a ``transformers`` tokenizer (both
encode without special tokens: ``prepare`` appends the end-of-document token itself, and a chat
template writes its own), and a plain function ``text -> list[int]``. Where ``prepare``'s workers are
spawned rather than forked (not on Linux) the adapter is pickled to them: a plain function must then
be defined at module level.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TextTokenizer"]


def _kind(tokenizer: Any) -> str:
    if isinstance(tokenizer, TextTokenizer):
        return "adapter"
    if type(tokenizer).__module__.split(".")[0] == "tokenizers" and hasattr(tokenizer, "to_str"):
        return "tokenizers"
    if hasattr(tokenizer, "apply_chat_template") and hasattr(tokenizer, "encode"):
        return "transformers"
    if callable(tokenizer):
        return "callable"
    raise ValueError(f"{type(tokenizer).__name__} is not a tokenizer: pass a tokenizers.Tokenizer, a transformers "
                     "tokenizer, or a function text -> list[int]")


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


class TextTokenizer:
    """``TextTokenizer(tokenizer)(text)`` → token ids (a list of ints).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``, a ``transformers`` tokenizer, or a function
            ``text -> list[int]``.
        vocab_size: the vocabulary size ids are checked against; by default the tokenizer's own
            (``None`` for a plain function: its ids are then only checked to fit 32 bits).
        name: the tokenizer's identity in the cache key. By default a hash of the vocabulary and merges
            (HF kinds) or of a function's module, name and bytecode; name a plain function whose result
            depends on more than its code (a file it loads) to re-prepare when that changes.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int | None = None, name: str | None = None) -> None:
        if isinstance(tokenizer, TextTokenizer):
            tokenizer = tokenizer.tokenizer
        self.kind = _kind(tokenizer)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else self._own_vocab_size()
        self.name = name

    def _own_vocab_size(self) -> int | None:
        if self.kind == "tokenizers":
            return int(self.tokenizer.get_vocab_size(with_added_tokens=True))
        if self.kind == "transformers":
            return len(self.tokenizer)
        return None

    def __call__(self, text: str) -> list[int]:
        if self.kind == "tokenizers":
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.kind == "transformers":
            return self.tokenizer.encode(text, add_special_tokens=False)
        return list(self.tokenizer(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[self(t) for t in texts]``, where the tokenizer can in one call (HF tokenizers encode a batch
        in Rust, on several threads where the process has not forked since)."""
        if not texts:
            return []
        if self.kind == "tokenizers":
            return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]
        if self.kind == "transformers" and getattr(self.tokenizer, "is_fast", False):
            return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [self(t) for t in texts]

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (a ``transformers`` tokenizer's), else ``None``."""
        return getattr(self.tokenizer, "chat_template", None) if self.kind == "transformers" else None

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool, template: str | None) -> str:
        """The text of ``messages`` under a Jinja template (``None``: the tokenizer's own)."""
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  chat_template=template)

    def fingerprint(self) -> str:
        """A hash naming what this tokenizer does, for the cache key of prepared data."""
        if self.name is not None:
            return _sha("name:" + self.name)
        if self.kind == "tokenizers":
            return _sha(self.tokenizer.to_str())
        if self.kind == "transformers":
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            body = backend.to_str() if backend is not None else json.dumps(sorted(self.tokenizer.get_vocab().items()))
            return _sha(f"{type(self.tokenizer).__name__}\n{self.chat_template}\n{body}")
        return _sha(_function_identity(self.tokenizer))


def _function_identity(function: Callable) -> str:
    # A function's code and constants: editing the function re-prepares, renaming a variable too
    # (a harmless miss); a callable object is named by its type and its attributes' repr.
    code = getattr(function, "__code__", None)
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', type(function).__qualname__)}"
    if code is not None:
        return f"{name}\n{code.co_code.hex()}\n{code.co_consts!r}"
    return f"{name}\n{type(function).__qualname__}\n{getattr(function, '__dict__', {})!r}"
