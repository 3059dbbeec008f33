"""The patch registry: names a plan's ``"patch"`` section can use instead of callables, so a plan
stays data (JSON files, the zoo).

A patch is ``patch(module, device_mesh, fqn, **args) -> None``; it runs on each module its plan key
matches, after the parameters are distributed and before the forward hooks, and may replace
``module.forward``. A plan entry is one of:

- a callable ``patch(module, device_mesh, fqn)``;
- a registered name, ``"vocab_parallel_embedding"``;
- a name with JSON arguments, ``{"name": "my_patch", "args": {"sizes": [64, 16, 16]}}``, which
  calls ``my_patch(module, device_mesh, fqn, sizes=[64, 16, 16])``.

Below the core and the zoo (it imports only ``spec.py``): the core (``api.py``) resolves entries
here and the zoo (``plans/``) registers its patches here; neither imports the other.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ndweave.dmodule.spec import PlanKeyError

__all__ = ["Patch", "PatchEntry", "patch_name", "register_patch", "registered_patches", "resolve_patch"]

Patch = Callable[..., None]
"""``patch(module, device_mesh, fqn, **args) -> None``."""
PatchEntry = Union[str, Mapping[str, Any], Callable[[nn.Module, DeviceMesh, str], None]]

# Name -> patch: the zoo's patches, registered as the zoo's modules are defined, and the user's.
_REGISTRY: dict[str, Patch] = {}


def register_patch(name: str, patch: Patch | None = None) -> Any:
    """Register ``patch`` under ``name``, so plans (and plan files) can name it; as a decorator
    without ``patch``. Returns the patch. A name is registered once (the same function again is a
    no-op, e.g. a module reloaded); another function under a taken name is an error::

        @register_patch("scale_heads")
        def scale_heads(module, device_mesh, fqn, *, factor=1):
            module.num_heads //= device_mesh.size() * factor

        plan = {"patch": {r"layers\\.\\d+\\.attn": [{"name": "scale_heads", "args": {"factor": 1}}]}}
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_patch: the name must be a non-empty string, got {name!r}")
    if patch is None:
        return functools.partial(register_patch, name)
    if not callable(patch):
        raise TypeError(f"register_patch({name!r}): {patch!r} is not callable; a patch is "
                        "patch(module, device_mesh, fqn, **args)")
    taken = _REGISTRY.get(name)
    if taken is not None and _qualname(taken) != _qualname(patch):
        raise ValueError(f"register_patch: the name {name!r} is taken by {_qualname(taken)}; choose another "
                         f"name for {_qualname(patch)}")
    _REGISTRY[name] = patch
    return patch


def registered_patches() -> dict[str, Patch]:
    """Every registered name and its patch (a copy)."""
    return dict(_REGISTRY)


def patch_name(entry: PatchEntry) -> str | None:
    """The registered name a plan entry uses, or ``None`` for a callable."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Mapping):
        return entry.get("name")
    return None


def resolve_patch(entry: PatchEntry, where: str) -> Callable[[nn.Module, DeviceMesh, str], None]:
    """The callable a plan entry stands for; ``where`` names the entry in errors (``"patch['fc1']"``).
    A name with arguments is checked against the patch's signature here, before any module is touched."""
    if callable(entry):
        return entry
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"name", "args"}
        args = entry.get("args") or {}
        if unknown or not isinstance(entry.get("name"), str) or not isinstance(args, Mapping):
            raise TypeError(f"{where}: {entry!r} is not a patch entry; write {{\"name\": <registered name>, "
                            "\"args\": {<keyword>: <JSON value>, ...}}")
        patch = _registered(entry["name"], where)
        try:
            inspect.signature(patch).bind(None, None, "", **args)
        except TypeError as error:
            raise TypeError(f"{where}: patch {entry['name']!r} does not take the arguments {dict(args)} ({error})") from None
        except ValueError:  # a builtin without a signature: its call will tell
            pass
        return functools.partial(patch, **args)
    if isinstance(entry, str):
        return _registered(entry, where)
    raise TypeError(f"{where}: a patch is a callable (module, device_mesh, fqn), a registered name, or "
                    f"{{\"name\": ..., \"args\": {{...}}}}; not {entry!r}")


def _registered(name: str, where: str) -> Patch:
    patch = _REGISTRY.get(name)
    if patch is None:
        raise PlanKeyError(f"{where}: unknown patch {name!r}; registered patches: {sorted(_REGISTRY)} "
                       "(register your own with ndweave.dmodule.register_patch)")
    return patch


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', None) or ''}.{getattr(fn, '__qualname__', repr(fn))}"
