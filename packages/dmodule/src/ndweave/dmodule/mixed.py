"""torch's "got mixed torch.Tensor and DTensor", raised deep inside an op, told in the user's terms.

The usual cause is a plain tensor reaching a module whose parameters are DTensors with no input plan
to lay it out. Checking every argument of every module on every call would cost each forward; instead
the root's call catches torch's error (nothing is paid until it is raised) and reads the traceback
for the innermost module whose ``forward`` was running with a plain tensor argument: that module, its
FQN and the argument name go into the message, with the plan entry that fixes it.
"""

from __future__ import annotations

import inspect
from types import TracebackType

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["MIXED_TENSORS", "explain_mixed_tensors"]

#: The text of torch's error (``torch.distributed.tensor._dispatch``) this module explains.
MIXED_TENSORS = "got mixed torch.Tensor and DTensor"


def explain_mixed_tensors(root: nn.Module, error: RuntimeError) -> RuntimeError | None:
    """A clearer error for torch's mixed-tensor ``error`` raised under ``root``'s forward, or ``None``
    when the traceback shows no module of ``root`` with a plain tensor argument (then re-raise torch's)."""
    fqns = {id(m): fqn for fqn, m in root.named_modules(remove_duplicate=False)}
    for module, arguments in reversed(list(_module_frames(error.__traceback__, fqns))):
        plain = [name for name, value in arguments.items()
                 if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)]
        if not plain or not any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            continue
        fqn = fqns[id(module)]
        key = f"{fqn}.input" if fqn else ".input"
        return RuntimeError(
            f"module {fqn or '<root>'!r} ({type(module).__name__}) got a plain torch.Tensor for argument "
            f"{plain[0]!r} while its parameters are DTensors; add an input plan for it "
            f'(e.g. {{"{key}": [[Replicate()]]}} in the forward plan, one placements list per argument, '
            "for a value every rank holds whole) or pass a DTensor"
        )
    return None


def _module_frames(tb: TracebackType | None, fqns: dict[int, str]):
    """(module, its forward's arguments) for each frame of ``tb`` running ``forward`` of a module in ``fqns``."""
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(module, nn.Module) and id(module) in fqns:
            info = inspect.getargvalues(frame)
            names = [n for n in info.args if n != "self"]
            yield module, {n: info.locals.get(n) for n in names}
        tb = tb.tb_next
