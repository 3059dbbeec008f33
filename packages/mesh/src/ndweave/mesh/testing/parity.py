"""Proof by parity: compare a parallel run with a single-process one, with tolerances that hold on
every machine. This module is the one place those tolerances live.

Two modes:

* **Strict** (:data:`STRICT`): both runs in float64 (:data:`STRICT_DTYPE`). Parallel runs sum in
  other orders than one process (all-reduce, reduce-scatter, split matmuls); in float64 that costs
  ~1e-16 per op, and even 20 steps of AdamW keep the two runs within ~1e-13 of each other, while a
  real sharding, ordering or scaling bug moves values by 1e-4 or more. So 1e-9 relative separates
  the two by orders of magnitude, whatever the CPU or GPU kernels. Every parity test has this mode.
* **Measured** (:func:`measured_tolerance`): where fp32 (or bf16 with fp32 masters) is the point.
  An fp32 bound tuned on one CPU fails on another (AVX2 vs AVX-512 kernels round differently, and
  AdamW turns that into steps of ~lr on near-zero grads). Instead the test trains its single-process
  reference more than once, in runs that differ *only in summation order* (the whole batch at once,
  and the same batch as micro-batches of two sizes whose grads are accumulated), and the bound is
  :data:`SAFETY` times the largest difference between them: what this machine's kernels do to a
  reordering, measured. (Measured on three kernel sets for the demo's GPT: a parallel run's largest
  difference was 1-2.2x the largest reordering's; one reordering alone was sometimes 30x smaller.)

Models in parity tests avoid parameters whose true gradient is exactly zero (a key-projection bias:
softmax ignores a per-query constant): Adam's ``m / sqrt(v)`` turns pure rounding noise there into
full-size steps in any precision, so no tolerance could separate noise from a bug.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "SAFETY",
    "STRICT",
    "STRICT_DTYPE",
    "Tolerance",
    "assert_close",
    "full_tensor",
    "max_difference",
    "measured_tolerance",
]

#: The dtype both sides of a strict parity test run in.
STRICT_DTYPE = torch.float64


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, elementwise (``torch.testing.assert_close``)."""

    rtol: float
    atol: float

    def kwargs(self) -> dict[str, float]:
        return {"rtol": self.rtol, "atol": self.atol}


#: Strict parity in float64 (see the module docstring for why this holds on any kernels).
STRICT = Tolerance(rtol=1e-9, atol=1e-12)

#: Measured bounds are this many times the spread of two reordered single-process runs: parallel
#: runs reorder more sums than one accumulation split does, but not orders of magnitude more.
SAFETY = 20.0

#: Floor of a measured bound, in units of the dtype's epsilon times the largest compared magnitude:
#: two reordered runs can come out bit-identical on small problems, which bounds nothing.
_FLOOR_EPS = 8.0


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole (unsharded) value of ``t`` as a plain tensor, detached, on CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


TensorsLike = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def _pairs(a: TensorsLike, b: TensorsLike) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(a, torch.Tensor):
        return [(a, b)]
    if isinstance(a, Mapping):
        if set(a) != set(b):
            raise ValueError(f"the runs compared differ in names: {sorted(set(a) ^ set(b))}")
        return [(a[k], b[k]) for k in a]
    if len(a) != len(b):
        raise ValueError(f"the runs compared have {len(a)} and {len(b)} tensors")
    return [(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b)]


def max_difference(a: TensorsLike, b: TensorsLike) -> float:
    """Largest elementwise ``|a - b|`` over matching tensors (a tensor, a list, or a dict by name)."""
    worst = 0.0
    for x, y in _pairs(a, b):
        x, y = full_tensor(x).double(), full_tensor(y).double()
        if x.numel():
            worst = max(worst, (x - y).abs().max().item())
    return worst


def measured_tolerance(run: TensorsLike, *reordered: TensorsLike, dtype: torch.dtype | None = None,
                       safety: float = SAFETY) -> Tolerance:
    """The fp32/bf16 parity bound from single-process runs that differ only in summation order.

    ``run`` and each of ``reordered`` are what the test compares (final parameters, losses...) from
    the reference trained more than once: e.g. on whole batches, and on the same batches as
    accumulated micro-batches of two sizes. The bound is ``safety`` times the largest difference of
    a reordered run from ``run`` (one reordering can happen to miss the element a parallel run
    perturbs most: take two or more), and at least a few epsilons of ``dtype`` (default: the
    tensors' own) at the largest magnitude compared.
    """
    if not reordered:
        raise TypeError("measured_tolerance needs at least one reordered run to measure against")
    pairs = _pairs(run, reordered[0])
    dtype = dtype or full_tensor(pairs[0][0]).dtype
    scale = max((full_tensor(x).double().abs().max().item() for x, _ in pairs if x.numel()), default=1.0)
    floor = _FLOOR_EPS * torch.finfo(dtype).eps * max(scale, 1.0)
    spread = max(max_difference(run, other) for other in reordered)
    return Tolerance(rtol=0.0, atol=max(safety * spread, floor))


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    """:data:`STRICT` for float64; any other dtype needs a measured bound, passed explicitly."""
    if dtype == STRICT_DTYPE:
        return STRICT
    raise TypeError(
        f"no default parity tolerance for {dtype}: run both sides in {STRICT_DTYPE} (strict parity), or pass "
        "tol=measured_tolerance(reference_run, reordered_reference_run)"
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "tensor",
                 tol: Tolerance | None = None, rtol: float | None = None, atol: float | None = None) -> None:
    """``torch.testing.assert_close`` on full values (DTensors are gathered), naming the tensor.

    The tolerance is ``tol``, or ``rtol``/``atol`` given together, or by default :data:`STRICT` for
    float64 (a TypeError for other dtypes: fp32 parity takes a :func:`measured_tolerance`).
    """
    a, e = full_tensor(actual), full_tensor(expected)
    if tol is None:
        if rtol is not None and atol is not None:
            tol = Tolerance(rtol, atol)
        elif rtol is None and atol is None:
            tol = default_tolerance(a.dtype)
        else:
            raise TypeError("give rtol and atol together, or tol=")
    try:
        torch.testing.assert_close(a, e.to(a.dtype), **tol.kwargs())
    except AssertionError as err:
        raise AssertionError(f"{name} differs from the single-process reference:\n{err}") from None
