"""The bytes of live tensors a process holds, and their peak, on any device (CPU included): what a
memory estimate is checked against.

torch's own tracker (``MemTracker``, from torch's distributed tools; subclassed in ``torch_compat``,
loaded on first use) counts every storage an op allocates while it is active, once per storage, until the storage is
freed, and keeps the peak of the sum per device (checked after each op). Its attribution to
modules is left off: it supports one iteration only, and its backward hooks fail inside the
``autograd.grad`` a pipeline stage runs; so the tracker can span a whole pipelined training run. Storages allocated before it
started are not seen: start it before the model is built.

    with TensorMemory() as memory:
        model = build()                  # parameters counted from here
        memory.reset_peak()              # the peak of the steps alone, model state included
        for batch in batches:
            step(model, batch)
    memory.peak_bytes("cpu")
"""

from __future__ import annotations

from ndweave.mesh.torch_compat import TensorMemory

__all__ = ["TensorMemory"]
