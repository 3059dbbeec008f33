"""torch's errors raised deep inside an op of a DModule's forward, told in the user's terms.

- "got mixed torch.Tensor and DTensor": usually a plain tensor reaching a module whose parameters are
  DTensors with no input plan to lay it out; the message names the module, the argument and the
  plan entry that fixes it.
- "Sharding propagation failed": DTensor could not fit an op's shapes together, usually an input of
  the wrong width; the message names the module, the width it expects (``in_features``,
  ``normalized_shape``) and the shape it got.

Checking every argument of every module on every call would cost each forward; instead the root's
call catches torch's error (nothing is paid until it is raised) and reads the traceback for the
innermost module of the model whose ``forward`` was running: its FQN, arguments and parameters go
into the message. Every name and shape in it is global (no rank's local piece), so ranks that hit
the same error raise the same message.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import TracebackType

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["MIXED_TENSORS", "SHARDING_PROPAGATION", "explain_op_error"]

#: The text of torch's error (``torch.distributed.tensor._dispatch``) for a plain tensor meeting DTensors.
MIXED_TENSORS = "got mixed torch.Tensor and DTensor"
#: The text of DTensor's error for an op whose input shapes or placements do not fit together.
SHARDING_PROPAGATION = "Sharding propagation failed"


def explain_op_error(root: nn.Module, error: RuntimeError) -> RuntimeError | None:
    """A clearer error for torch's ``error`` raised under ``root``'s forward, or ``None`` when it is
    not one of the errors above or the traceback shows no module of ``root`` to name (re-raise torch's)."""
    text = str(error)
    if MIXED_TENSORS in text:
        return _explain_mixed_tensors(root, error)
    if SHARDING_PROPAGATION in text:
        return _explain_sharding_failure(root, error)
    return None


def _explain_mixed_tensors(root: nn.Module, error: RuntimeError) -> RuntimeError | None:
    fqns = _fqns(root)
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


def _explain_sharding_failure(root: nn.Module, error: RuntimeError) -> RuntimeError | None:
    fqns = _fqns(root)
    frames = list(_module_frames(error.__traceback__, fqns))
    if not frames:
        return None
    module, arguments = frames[-1]  # the innermost: the module whose forward ran the op
    name = f"module {fqns[id(module)] or '<root>'!r} ({type(module).__name__})"
    tensors = {n: v for n, v in arguments.items() if isinstance(v, torch.Tensor)}
    torch_says = str(error).strip().splitlines()[0]
    expected = _expected_trailing_shape(module)
    if expected is not None and tensors:
        (arg, x), (width, attribute) = next(iter(tensors.items())), expected
        got = tuple(x.shape[-len(width):])
        if got != width:
            return RuntimeError(
                f"{name} takes inputs whose last {'dim is' if len(width) == 1 else f'{len(width)} dims are'} "
                f"{_dims(width)} ({attribute}), but got {arg!r} of shape {_shape(x)}; pass inputs of width "
                f"{_dims(width)}, or build the module for width {_dims(got)} (DTensor: {torch_says})"
            )
    params = ", ".join(f"{n} {_shape(p)}" for n, p in module.named_parameters(recurse=False)) or "none"
    inputs = ", ".join(f"{n!r} {_shape(v)}" for n, v in tensors.items()) or "no tensors"
    return RuntimeError(
        f"{name}: DTensor cannot run its forward on these shapes and placements: inputs {inputs}; parameters "
        f"{params}; check its inputs' shapes and the plan's placements for them (DTensor: {torch_says})"
    )


def _expected_trailing_shape(module: nn.Module) -> tuple[tuple[int, ...], str] | None:
    """The trailing shape ``module`` takes its first input in, from the attribute torch's layers
    (and HF's, by the same names) keep it in: ``in_features``, ``normalized_shape``."""
    in_features = getattr(module, "in_features", None)
    if isinstance(in_features, int):
        return (in_features,), f"in_features={in_features}"
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and shape and all(isinstance(n, int) for n in shape):
        return tuple(shape), f"normalized_shape={tuple(shape)}"
    return None


def _dims(sizes: tuple[int, ...]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else str(sizes)


def _shape(t: torch.Tensor) -> str:
    """The global shape, and the placements of a DTensor: the same text on every rank."""
    if isinstance(t, DTensor):
        return f"{tuple(t.shape)} {list(t.placements)}"
    return f"{tuple(t.shape)} (plain tensor)"


def _fqns(root: nn.Module) -> dict[int, str]:
    return {id(m): fqn for fqn, m in root.named_modules(remove_duplicate=False)}


def _module_frames(tb: TracebackType | None, fqns: dict[int, str]) -> Iterator[tuple[nn.Module, dict]]:
    """(module, its forward's arguments) for each frame of ``tb`` running ``forward`` of a module in ``fqns``."""
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(module, nn.Module) and id(module) in fqns:
            info = inspect.getargvalues(frame)
            names = [n for n in info.args if n != "self"]
            yield module, {n: info.locals.get(n) for n in names}
        tb = tb.tb_next
