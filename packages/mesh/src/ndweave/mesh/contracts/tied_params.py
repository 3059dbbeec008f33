"""Marking the second copy of a tied weight, so a global gradient norm counts it once and a
checkpoint keeps its state once.

With pipeline parallelism a weight shared by the first and the last layer (the input embedding and
the LM head) lives on two stages: each holds a copy and both copies' grads are synced to the same
value. A global grad norm sums every stage's owned grads, so it would count that weight twice. The
stage holding the *second* copy marks it, naming the *primary*: the FQN of the counted copy, which is
the weight's name in the whole model on one device (its first name in ``named_parameters()``)::

    from ndweave.mesh.contracts import mark_tied_replica, tied_primary

    mark_tied_replica(last_stage.lm_head.weight, primary="transformer.wte.weight")
    tied_primary(last_stage.lm_head.weight)      # "transformer.wte.weight"

Optimizers (``ndweave.optim``) skip marked parameters when they count the norm (they still step
them); checkpointing (``ndweave.checkpoint``) saves a marked copy's optimizer state once, under the
primary's FQN, as one device's optimizer holds it, and loads it from there into every copy. Within
one rank, tied parameters are one object and need no mark. Mark the parameter that training uses:
after parallelizing and materializing, since replacing a parameter drops its mark.
"""

from __future__ import annotations

import torch

__all__ = ["is_tied_replica", "mark_tied_replica", "tied_primary"]

# The mark is an attribute of the parameter itself (not a registry here): it lives and dies with the
# parameter and needs no global state. Its value is the primary's FQN, or True when none was given.
# Read and write it only through the functions below.
_MARK = "_ndweave_tied_replica"


def mark_tied_replica(param: torch.Tensor, primary: str | None = None) -> torch.Tensor:
    """Mark ``param`` as the second copy of a weight tied across pipeline stages; returns it.

    ``primary``: the FQN of the counted copy (the weight's name on one device). Without it the mark
    still keeps grad norms right, but a checkpoint cannot tell which saved state the copy shares.
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"mark_tied_replica takes a parameter (a tensor); got {type(param).__name__}")
    if primary is not None and not isinstance(primary, str):
        raise TypeError(f"mark_tied_replica: primary is the counted copy's FQN (a str); got {type(primary).__name__}")
    setattr(param, _MARK, primary if primary is not None else True)
    return param


def is_tied_replica(param: torch.Tensor) -> bool:
    """Whether ``param`` was marked with :func:`mark_tied_replica`."""
    return getattr(param, _MARK, None) is not None


def tied_primary(param: torch.Tensor) -> str | None:
    """The primary's FQN :func:`mark_tied_replica` recorded for ``param``; ``None`` if none was."""
    mark = getattr(param, _MARK, None)
    return mark if isinstance(mark, str) else None
