"""The attention mask of packed samples: causal, and block-diagonal over documents."""

from __future__ import annotations

import torch

__all__ = ["document_mask"]


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, 1, S, S)`` bool, ``True`` where query ``i`` may attend to key ``j``: ``j <= i`` and both
    tokens in the same document. For eager attention or ``F.scaled_dot_product_attention(attn_mask=)``.

    ``document_ids`` is ``(B, S)`` (or ``(S,)``), the samples' ``"document_ids"``. Padding (id -1)
    attends to padding, so no row is empty (an empty row makes softmax NaN)::

        >>> document_mask(torch.tensor([0, 0, 1]))[0, 0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [0, 0, 1]], dtype=torch.int32)
    """
    ids = document_ids if document_ids.dim() == 2 else document_ids.unsqueeze(0)
    size = ids.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=ids.device).tril()
    return ((ids.unsqueeze(-1) == ids.unsqueeze(-2)) & causal).unsqueeze(1)
