"""Your data for the GPT job (``--data``): local files tokenized once, packed, read by global position.

Built on ``ndweave.data``: rank 0 runs ``prepare`` (token shards in ``--data-cache``, default
``CHECKPOINT_DIR/prepared``, cached by a hash of the files, the tokenizer and the settings), the other
ranks wait for it, then every rank opens the shards and builds the same ``PackedDataset`` (a
``Mixture`` for ``PATH:WEIGHT`` sources). Sample ``k`` is a pure function of the shards, the seed and
``k``, so the stream is global as the bytes' is: a step trains on the next ``--global-batch`` samples
and each DP rank reads its contiguous slice (``DataPosition.rank_slice``); the checkpoint holds the
position (``{"samples_seen": n}``) and :attr:`TokenData.fingerprint`, the prepared data's hash.

A batch is ``(inputs, targets)``: ``inputs`` the token ids, or for packings that keep documents apart
(``documents``, ``first_fit``) a dict of the model's keyword inputs ``input_ids``, ``position_ids``
(restarting at every document) and ``attention_mask`` (``document_mask``: causal, block-diagonal,
``(B, 1, S, S)`` bool, which transformers passes to its attention as it is); ``targets`` the next
tokens with :data:`IGNORE` where the loss mask is off (a document's boundary, padding, an SFT prompt).

    data = TokenData(config, rank=0)                       # prepares on rank 0 (collective)
    x, y = data.batch(position, global_batch, dp_rank, dp_size)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ndweave.checkpoint import DataPosition
from ndweave.data import Mixture, PackedDataset, Shards, document_mask, prepare
from ndweave_gpt.data import DOCUMENT_PACKINGS, bytes_text

__all__ = ["IGNORE", "TokenData", "bytes_tokenizer", "load_tokenizer", "parse_source"]

#: The target of a token the loss skips (``F.cross_entropy``'s default ``ignore_index``).
IGNORE = -100


def bytes_tokenizer(text: str) -> list[int]:
    """Text as its UTF-8 bytes (ids 0..255): ``--data`` without a tokenizer."""
    return list(text.encode())


def load_tokenizer(folder: str) -> tuple[Any, int | None]:
    """A local Hugging Face tokenizer folder as ``(tokenizer, eos_id)``: a ``transformers`` tokenizer
    where transformers is installed (it brings the chat template), else a ``tokenizers.Tokenizer``."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None
    if AutoTokenizer is not None:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        return tokenizer, tokenizer.eos_token_id
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit(f"error: --tokenizer {folder} needs the tokenizers (or transformers) package: "
                         "`pip install tokenizers`") from None
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    settings = Path(folder) / "tokenizer_config.json"
    eos = json.loads(settings.read_text()).get("eos_token") if settings.is_file() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return tokenizer, tokenizer.token_to_id(eos) if eos else None


def parse_source(spec: str) -> tuple[str, float]:
    """``PATH[:WEIGHT]`` → ``(path, weight)`` (weight 1 when none is given)."""
    path, _, weight = spec.rpartition(":")
    try:
        return (path, float(weight)) if path else (spec, 1.0)
    except ValueError:
        return spec, 1.0  # a colon in the path itself


class TokenData:
    """``--data`` as the job reads it (every rank builds it; rank 0 prepares, collectively).

    Args:
        config: the job's config (``JobConfig``): data flags, block size, seed, checkpoint dir.
        vocab_size: the model's vocabulary: every token id must lie below it.
        rank: this process's global rank (0 prepares).
        show: rank 0's progress bar while tokenizing.
    """

    def __init__(self, config: Any, vocab_size: int, rank: int, show: bool = False) -> None:
        data = config.data
        self.block_size, self.model = config.model.block_size, config.model.name
        cache = data.data_cache or os.path.join(config.checkpoint.checkpoint_dir, "prepared")
        if data.tokenizer:
            tokenizer, eos_id = load_tokenizer(data.tokenizer)
            name = None
        else:
            tokenizer, eos_id, name = bytes_tokenizer, None, "bytes"
        self._decode = getattr(tokenizer, "decode", None)
        self.real_tokens = 0
        """The last batch's tokens that are not padding (what the progress bar counts)."""
        settings = dict(eos_id=eos_id, vocab_size=vocab_size, workers=data.data_workers, tokenizer_name=name)
        sources = [parse_source(s) for s in data.data]
        what = "--data"

        def prepare_all(progress: bool) -> list[Shards]:
            return [prepare(path, tokenizer, cache, progress=progress, **settings) for path, _ in sources]

        shards = _on_rank_zero(lambda: prepare_all(show), rank, what, vocab_size, self.model)
        chat = any(s.has_loss_mask for s in shards)
        self.packing = _packing(data.packing, chat)
        seed = config.training.seed
        try:
            datasets = [PackedDataset(s, self.block_size, packing=self.packing, seed=seed) for s in shards]
        except ValueError as error:  # no sample at this --block-size: every rank alike
            raise SystemExit(f"error: --data (--packing {self.packing}, --block-size {self.block_size}): "
                             f"{error}") from None
        weights = [w for _, w in sources]
        self.dataset = datasets[0] if len(datasets) == 1 else Mixture(list(zip(datasets, weights)), seed=seed)
        names = [s.path.name + (f":{w:g}" if len(shards) > 1 else "") for s, w in zip(shards, weights)]
        self.fingerprint = "+".join(names) + f"/{self.packing}/{self.block_size}"
        """The data's identity in a checkpoint: the prepared shards' hashes (files, tokenizer, settings),
        the weights, the packing and the block size."""
        self.validation_data = None
        if data.val_data:
            what = "--val-data"
            held = _on_rank_zero(lambda: [prepare(list(data.val_data), tokenizer, cache, progress=show, **settings)],
                                 rank, what, vocab_size, self.model)[0]
            try:
                self.validation_data = PackedDataset(held, self.block_size, packing=self.packing, shuffle=False)
            except ValueError as error:
                raise SystemExit(f"error: --val-data (--packing {self.packing}): {error}") from None

    @property
    def prompt(self) -> list[int]:
        """What ``--sample`` writes after: the first document's first tokens (up to a quarter sample)."""
        first = self.dataset[0]
        start = first["document_ids"] == first["document_ids"][0]
        return first["input_ids"][start][:max(1, self.block_size // 4)].tolist()

    def text(self, tokens: list[int]) -> str:
        """``tokens`` as text: the tokenizer's decoding, or UTF-8 bytes without one."""
        return self._decode(tokens) if self._decode is not None else bytes_text(tokens)

    @property
    def takes_mask(self) -> bool:
        """Whether the model gets position ids and the document mask (packings that keep documents apart;
        what :func:`~ndweave_gpt.data.keeps_documents_apart` tells from the flags)."""
        return self.packing in DOCUMENT_PACKINGS

    def _batch_of(self, samples: list[dict[str, torch.Tensor]]) -> tuple[Any, torch.Tensor]:
        batch = torch.utils.data.default_collate(samples)
        self.real_tokens = int((batch["document_ids"] >= 0).sum())
        targets = batch["targets"].masked_fill(~batch["loss_mask"], IGNORE)
        if not self.takes_mask:
            return batch["input_ids"], targets
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
                "attention_mask": document_mask(batch["document_ids"])}, targets

    def batch(self, position: DataPosition, global_batch: int, dp_rank: int = 0,
              dp_size: int = 1) -> tuple[Any, torch.Tensor]:
        """This DP rank's slice of the next global batch (the position is advanced by the caller,
        after the optimizer step)."""
        part = position.rank_slice(global_batch, dp_rank, dp_size)
        return self._batch_of([self.dataset[k] for k in range(part.start, part.stop)])

    def validation(self, count: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[Any, torch.Tensor]:
        """This DP rank's slice of the first ``count`` samples of ``--val-data`` (the same every evaluation)."""
        per_rank = count // dp_size
        return self._batch_of([self.validation_data[k] for k in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)])


def _packing(packing: str, chat: bool) -> str:
    """``--packing auto`` resolved: documents kept apart (position ids and the document mask, which
    nanogpt and transformers' models take), first-fit for chats."""
    if packing != "auto":
        return packing
    return "first_fit" if chat else "documents"


def _on_rank_zero(work, rank: int, what: str, vocab_size: int, model: str):
    """``work()`` on rank 0 first (it prepares), then on the others (they find its cache); a failure on
    rank 0 is every rank's one-line error, so none waits for shards that will not come."""
    error = None
    result = None
    if rank == 0:
        try:
            result = work()
        except (ValueError, OSError) as failed:
            error = str(failed)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        if "outside the vocabulary" in error:
            error += f" (the model, {model}, has {vocab_size} token ids)"
        if "no chat_template" in error or "no chat template" in error:
            error += "; for the job: a --tokenizer folder whose tokenizer_config.json holds a chat_template"
        raise SystemExit(f"error: {what}: {error}")
    return result if rank == 0 else work()

