"""Marking the second copy of a tied weight, so a global gradient norm counts it once.

With pipeline parallelism a weight shared by the first and the last layer (the input embedding and
the LM head) lives on two stages: each holds a copy and both copies' grads are synced to the same
value. A global grad norm sums every stage's owned grads, so it would count that weight twice. The
stage holding the *second* copy marks it::

    from ndweave.mesh.contracts import mark_tied_replica

    mark_tied_replica(last_stage.lm_head.weight)   # the embedding on stage 0 is counted, this is not

and optimizers (``ndweave.optim``) skip marked parameters when they count the norm (they still step
them). Within one rank, tied parameters are one object and need no mark. Mark the parameter that
training uses: after parallelizing and materializing, since replacing a parameter drops its mark.
"""

from __future__ import annotations

import torch

__all__ = ["is_tied_replica", "mark_tied_replica"]

# The mark is an attribute of the parameter itself (not a registry here): it lives and dies with the
# parameter and needs no global state. Read and write it only through the two functions below.
_MARK = "_ndweave_tied_replica"


def mark_tied_replica(param: torch.Tensor) -> torch.Tensor:
    """Mark ``param`` as the second copy of a weight tied across pipeline stages; returns it."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"mark_tied_replica takes a parameter (a tensor); got {type(param).__name__}")
    setattr(param, _MARK, True)
    return param


def is_tied_replica(param: torch.Tensor) -> bool:
    """Whether ``param`` was marked with :func:`mark_tied_replica`."""
    return getattr(param, _MARK, False) is True
