"""Chat records as token ids with a loss mask on the assistant's tokens only.

Two templates:

- **The tokenizer's own** (a ``transformers`` tokenizer's ``chat_template``, or a Jinja string
  passed as ``chat_template`` with such a tokenizer). The conversation is rendered prefix by prefix:
  message ``i``'s tokens are those the rendering of ``messages[:i+1]`` adds to that of
  ``messages[:i]``, and an assistant message's trained tokens are those after the generation prompt
  (``add_generation_prompt=True``), so the ``<|assistant|>``-style header is never trained on. A
  template whose renderings are not prefixes of each other is refused, since its masks would be
  guesses.
- **ndweave's default** (``chat_template="default"``), for tokenizers without a template: each
  message is ``"<|{role}|>\\n"`` (not trained on) then ``"{content}<|end|>\\n"`` (trained on when the
  role is ``assistant``), each piece tokenized on its own so the mask is exact. The markers are plain
  text: tokenizers without them as special tokens spell them out in several tokens.

The end-of-document token ``prepare`` appends is trained on when the last message is the assistant's
(the model learns to stop), else not.
"""

from __future__ import annotations

from collections.abc import Sequence

from ndweave.data.tokenizer import TextTokenizer

__all__ = ["DEFAULT_CHAT_TEMPLATE", "tokenize_chat"]

#: the value of ``chat_template`` that selects ndweave's default template (module docstring)
DEFAULT_CHAT_TEMPLATE = "default"


def _check(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: message {i} must be an object with string 'role' and 'content' fields, "
                             f"got {message!r:.80}")
    return messages


def tokenize_chat(messages: Sequence[dict], tokenizer: TextTokenizer, *, chat_template: str | None,
                  where: str = "a chat record") -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and, per token, whether it is trained on (the assistant's).

    ``chat_template``: ``None`` (the tokenizer's own template), ``"default"`` (ndweave's, module
    docstring) or a Jinja template string (with a ``transformers`` tokenizer).
    """
    messages = _check(messages, where)
    if chat_template == DEFAULT_CHAT_TEMPLATE:
        return _default(messages, tokenizer)
    if tokenizer.kind != "transformers":
        if chat_template is None:
            name = getattr(tokenizer.tokenizer, "__name__", type(tokenizer.tokenizer).__name__)
            raise ValueError(f"{where} is a chat ('messages') but the tokenizer ({name}) "
                             "has no chat template: pass chat_template='default' (ndweave's documented template), or "
                             "a transformers tokenizer that has one")
        raise ValueError(f"{where}: a Jinja chat template needs a transformers tokenizer to render it; pass one, "
                         "or chat_template='default'")
    if chat_template is None and not tokenizer.chat_template:
        raise ValueError(f"{where} is a chat ('messages') but {type(tokenizer.tokenizer).__name__} has no chat_template: "
                         "pass chat_template= (a Jinja template string, or 'default' for ndweave's documented one)")
    return _rendered(messages, tokenizer, chat_template, where)


def _default(messages: list[dict], tokenizer: TextTokenizer) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    for message in messages:
        header = tokenizer(f"<|{message['role']}|>\n")
        body = tokenizer(f"{message['content']}<|end|>\n")
        ids += header + body
        mask += [False] * len(header) + [message["role"] == "assistant"] * len(body)
    return ids, mask


def _rendered(messages: list[dict], tokenizer: TextTokenizer, template: str | None,
              where: str) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            head = tokenizer(tokenizer.render_chat(messages[:i], add_generation_prompt=True, template=template))
            _extend(ids, mask, head, False, where)
        full = tokenizer(tokenizer.render_chat(messages[: i + 1], add_generation_prompt=False, template=template))
        _extend(ids, mask, full, message["role"] == "assistant", where)
    return ids, mask


def _extend(ids: list[int], mask: list[bool], rendered: list[int], trained: bool, where: str) -> None:
    if rendered[: len(ids)] != ids:
        raise ValueError(f"{where}: the chat template does not render a conversation's prefixes as prefixes of it, so "
                         "the assistant's tokens cannot be told apart; use a template that does, or chat_template='default'")
    mask += [trained] * (len(rendered) - len(ids))
    ids += rendered[len(ids):]
