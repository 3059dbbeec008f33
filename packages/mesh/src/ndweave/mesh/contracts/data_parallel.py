"""The contract every data-parallel wrapper meets, so that what drives it (a sharded optimizer, a
pipeline schedule) works with any of them: ``ndweave.ddp.DistributedDataParallel``,
``ndweave.mesh.testing.ReferenceDataParallel``, or your own.

A *step* runs from ``zero_grad_buffer()`` (or construction) to ``finish_grad_sync()``. Within it the
model runs ``k >= 1`` micro-batches, forward and backward each; what they are told decides when the
grads travel::

    for i, (x, y) in enumerate(micro_batches):
        model.set_is_last_microbatch(i == k - 1)      # or: all but the last inside model.no_sync()
        (loss_fn(model(x), y) / k).backward()
    model.finish_grad_sync()                          # the optimizer calls this in step()

* A backward while *not* the last micro-batch only accumulates (adds) its grads locally: no
  collective is issued. Except where the wrapper keeps only gradient shards (ZeRO-2: ``grad_data``
  is one rank's range), which has nowhere to keep a local sum: it reduces every micro-batch's grads
  as that backward ends, so every backward issues collectives (the result is the same sum).
* The backward of the last micro-batch (the default state) adds its grads too and may launch the
  reduction of the accumulated sum (``ndweave.ddp`` overlaps it with the rest of backward);
  ``finish_grad_sync()`` launches whatever is left and waits. Calling it again is harmless.
* After it, the synced grad of every parameter is ``reduce(sum over micro-batches of the local
  grads)`` over the data-parallel group, where ``reduce`` is the mean over DP ranks when
  ``grad_reduction == "mean"`` and the sum when ``"sum"``. With a per-micro-batch mean loss divided
  by ``k`` as above, ``"mean"`` gives exactly the grad of the mean loss over the global batch.
* Where that grad is: if the buckets carry ``param_data`` (laid out for a sharded optimizer, see
  :func:`uses_distributed_optimizer`), in ``bucket.reduced_grad()`` (``grad_data[shard_range()]``,
  or all of a ZeRO-2 ``grad_data``) of every bucket on each DP rank, and nowhere else; otherwise in the whole of every bucket's ``grad_data`` and in
  every synced parameter's ``.grad``.
* ``zero_grad_buffer()`` zeroes every ``grad_data`` and starts a new step (optimizers' ``zero_grad()``
  call it). Whether grads left from an earlier step without it are carried over is up to the wrapper.

Every DP rank must run the same micro-batches and calls. ``check_data_parallel`` in
``ndweave.mesh.testing`` checks a wrapper against this contract on real ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Literal, Protocol, runtime_checkable

from ndweave.mesh.contracts.grad_buckets import GradBucket

__all__ = ["DataParallelWrapper", "GradReduction", "MicroBatchControl", "rank_slice", "uses_distributed_optimizer"]

#: How a data-parallel wrapper combines the ranks' grads: their mean or their sum.
GradReduction = Literal["mean", "sum"]


@runtime_checkable
class DataParallelWrapper(Protocol):
    """A data-parallel model wrapper: grad buckets, grad sync, micro-batch control (module docstring).

    The names are Megatron's (``no_sync``, ``set_is_last_microbatch``, ``finish_grad_sync``,
    ``zero_grad_buffer``); ``grad_buckets()`` exposes the buffers a sharded optimizer steps.
    """

    @property
    def grad_reduction(self) -> GradReduction:
        """``"mean"`` or ``"sum"``: what the synced grads are over the data-parallel ranks."""
        ...

    def grad_buckets(self) -> Sequence[GradBucket]:
        """Every bucket of every dtype, in the order their reductions are launched."""
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Context manager: backward passes inside it only accumulate their grads locally."""
        ...

    def set_is_last_microbatch(self, is_last: bool) -> None:
        """Say whether the next backward passes are the last micro-batch of the step (``True``: they
        launch the sync) or not (``False``: they only accumulate). Stays until changed."""
        ...

    def finish_grad_sync(self) -> None:
        """Launch what is not launched yet and wait for every bucket's reduction (see
        ``GradSyncable``); harmless to call twice."""
        ...

    def zero_grad_buffer(self) -> None:
        """Zero all grad buffers and reset per-step state, ready for the next step."""
        ...


class MicroBatchControl:
    """The micro-batch half of :class:`DataParallelWrapper`, to inherit: ``no_sync()`` and
    ``set_is_last_microbatch()`` keep one flag, ``is_last_microbatch``, that the wrapper reads when a
    backward delivers grads (``True`` until told otherwise). ``no_sync()`` restores the flag it
    found, so blocks nest and a schedule's ``set_is_last_microbatch`` survives them."""

    is_last_microbatch: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block only accumulate their grads locally."""
        before, self.is_last_microbatch = self.is_last_microbatch, False
        try:
            yield
        finally:
            self.is_last_microbatch = before

    def set_is_last_microbatch(self, is_last: bool) -> None:
        """Whether the next backward passes are the last micro-batch of the step (they launch the sync)."""
        self.is_last_microbatch = bool(is_last)


def uses_distributed_optimizer(wrapper: DataParallelWrapper) -> bool:
    """Whether ``wrapper`` is laid out for a sharded optimizer (Megatron's
    ``use_distributed_optimizer=True``): its buckets carry ``param_data``, and each DP rank holds
    reduced grads only in its ``shard_range`` of each bucket. Read from the buckets, so it cannot
    disagree with them; ``False`` for a wrapper without buckets."""
    kinds = {bucket.param_data is not None for bucket in wrapper.grad_buckets()}
    if len(kinds) > 1:
        raise ValueError(
            f"{type(wrapper).__name__} has buckets with and without param_data: a wrapper is laid out for a "
            "sharded optimizer in all its buckets or in none"
        )
    return kinds == {True}


def rank_slice(global_batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """The part of a global batch DP rank ``dp_rank`` of ``dp_size`` trains on: the ``dp_rank``-th of
    ``dp_size`` equal contiguous slices (``ValueError`` unless the sizes divide). The one rule every
    ndweave data source splits global batches by (``ndweave.checkpoint.DataPosition``,
    ``ndweave.data.TokenStream``), so their positions agree at any DP size.

    >>> rank_slice(8, 1, 4)
    slice(2, 4, None)
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} lies outside a data-parallel size of {dp_size}")
    if global_batch_size % dp_size:
        raise ValueError(f"a global batch of {global_batch_size} samples does not split over {dp_size} data-parallel "
                         f"ranks; use a global batch size divisible by {dp_size}")
    per_rank = global_batch_size // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
