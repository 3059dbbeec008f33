"""``TensorMemory``: live tensor bytes and their peak, counted by torch's tracker, across module calls
repeated per micro-batch and the ``autograd.grad`` a pipeline stage runs (both break torch's
module-attributing tracker)."""

import torch
from torch import nn

from ndweave.mesh.testing.memory import TensorMemory


def test_live_bytes_and_the_peak_follow_allocations_and_frees():
    with TensorMemory() as memory:
        a = torch.zeros(1000)                      # 4000 B
        b = torch.zeros(500, dtype=torch.float64)  # 4000 B
        view = a[10:]                              # a view allocates nothing
        assert memory.current_bytes() == 8000
        del b
        assert memory.current_bytes() == 4000 and memory.peak_bytes() == 8000
        memory.reset_peak()
        assert memory.peak_bytes() == 4000
        c = torch.ones(250)
        assert memory.peak_bytes() == 5000
    del view, c
    assert memory.peak_bytes("meta") == 0


def test_repeated_module_calls_and_autograd_grad_are_counted():
    with TensorMemory() as memory:
        layer = nn.Linear(16, 16, bias=False)      # 1024 B of weight, counted from its creation
        outputs = [layer(torch.randn(4, 16, requires_grad=True)) for _ in range(3)]  # three micro-batches
        for out in outputs:
            torch.autograd.grad(out.sum(), [layer.weight])
        held = memory.current_bytes()
    assert held >= 1024 + 3 * 4 * 16 * 4  # the weight and each micro-batch's output, still referenced
    assert memory.peak_bytes() >= held
