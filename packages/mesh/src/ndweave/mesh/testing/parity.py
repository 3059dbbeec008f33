"""Helpers for proof-by-parity tests: compare a parallel run with a single-process one."""

from __future__ import annotations

import torch

__all__ = ["full_tensor", "assert_close"]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole (unsharded) value of ``t`` as a plain tensor, detached, on CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "tensor",
                 rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``torch.testing.assert_close`` on full values, naming the tensor and its worst element."""
    a, e = full_tensor(actual), full_tensor(expected)
    try:
        torch.testing.assert_close(a, e.to(a.dtype), rtol=rtol, atol=atol)
    except AssertionError as err:
        raise AssertionError(f"{name} differs from the single-process reference:\n{err}") from None
