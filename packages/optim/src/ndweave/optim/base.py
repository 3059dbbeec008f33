"""What both ndweave optimizers share: being a ``torch.optim.Optimizer`` to the outside world
(lr schedulers check ``isinstance`` and edit ``param_groups``), backed by an inner torch optimizer."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from ndweave.mesh.torch_compat import optimizer_load_state_dict_hooks, optimizer_state_dict_hooks
from ndweave.optim.grad_norm import clip_by_norm, global_norm
from ndweave.optim.loss_scale import unscale_and_check

__all__ = ["NonFiniteGradError", "WrappedOptimizer", "ON_NONFINITE"]

#: What ``step()`` does when the global grad norm is inf or nan (the same on every rank: the norm is
#: all-reduced): ``"raise"`` :class:`NonFiniteGradError` (the default); ``"skip"`` the step with a
#: ``RuntimeWarning`` (``last_step_skipped``; nothing zeroed or clipped); ``"unchecked"``: step as
#: torch does (no norm computed without clipping: the opt-out of its cost). With a ``loss_scaler``
#: its own overflow check skips first.
ON_NONFINITE: tuple[str, ...] = ("raise", "skip", "unchecked")


class NonFiniteGradError(FloatingPointError):
    """The global grad norm is inf or nan (raised by ``step()`` on every rank with ``on_nonfinite="raise"``)."""


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch ``Optimizer`` whose ``param_groups`` and ``state`` are those of ``self.inner``.

    ``torch.optim.Optimizer.__init__`` is deliberately not called: it would register the params it is
    given as its own; here the inner optimizer owns them and this object only forwards. Everything
    else ``__init__`` sets up is: the step, state-dict and load-state-dict hook registries
    (``register_step_pre_hook`` and friends work, and run around this optimizer's ``step()``,
    ``state_dict()`` and ``load_state_dict()``) and torch's step wrapper (profiling, global hooks,
    the flag lr schedulers check).
    """

    inner: torch.optim.Optimizer

    def _init_wrapper(self, inner: torch.optim.Optimizer, models: Sequence[torch.nn.Module], *, clip_grad: float,
                      loss_scaler: Any, grad_norm_group: dist.ProcessGroup | None,
                      on_nonfinite: Literal["raise", "skip", "unchecked"] = "raise") -> None:
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        self.inner = inner
        self.models = list(models)
        # torch's own set-up of the hook registries and the step wrapper, minus the params (what
        # Optimizer.__setstate__ does for an unpickled optimizer: the documented path that skips them)
        torch.optim.Optimizer.__setstate__(self, {"defaults": inner.defaults})
        self.clip_grad = float(clip_grad)
        self.loss_scaler = loss_scaler
        self.grad_norm_group = grad_norm_group
        self.on_nonfinite = on_nonfinite
        self.last_step_skipped = False
        """``True`` when the last ``step()`` found inf/nan grads and changed nothing."""
        self._grads_ready = False
        self._found_inf = False
        self._step_norm: torch.Tensor | None = None  # this step's global norm, once computed
        self._grads_as_synced = False  # no grad scaled since the sync (a norm of whole grads holds)

    # ``param_groups`` and ``state`` live on the inner optimizer (lr schedulers edit them in place)
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value) -> None:
        self.inner.state = value

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        torch.optim.Optimizer.__setstate__(self, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def get_parameters(self) -> list[torch.Tensor]:
        """Every parameter the inner optimizer steps, group by group (veScale's ``get_parameters``): for a
        ``DistributedOptimizer`` these are this rank's 1-D master shards, not the model's params."""
        return [p for group in self.inner.param_groups for p in group["params"]]

    def state_dict(self, **options: Any) -> dict[str, Any]:  # type: ignore[override]
        """This optimizer's state (see the subclass, and its ``options``), with torch's state-dict hooks
        run around it."""
        pre_hooks, post_hooks = optimizer_state_dict_hooks(self)
        for hook in pre_hooks.values():
            hook(self)
        state_dict = self._state_dict(**options)
        for hook in post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: Any, **options: Any) -> None:  # type: ignore[override]
        """Load ``state_dict`` (see the subclass, and its ``options``), with torch's load-state-dict
        hooks run around it."""
        pre_hooks, post_hooks = optimizer_load_state_dict_hooks(self)
        for hook in pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict, **options)
        for hook in post_hooks.values():
            hook(self)

    # to be provided by subclasses
    def _state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_state_dict(self, state_dict: Any) -> None:
        raise NotImplementedError

    def _owned_grads(self) -> list[torch.Tensor]:
        """The local grad tensors this rank owns for the norm (see ``grad_norm``)."""
        raise NotImplementedError

    def _local_grads(self) -> list[torch.Tensor]:
        """Every local grad the step will use (owned or a replica of one): what gets scaled."""
        return self._owned_grads()

    def _whole_grads(self) -> list[torch.Tensor] | None:
        """Every grad the norm covers, where each rank of ``grad_norm_group`` holds them all alike (an
        all-reduced data-parallel sync over that whole group): the norm then needs no collective.
        ``None`` (the default): the norm sums the ranks' owned grads with an all-reduce."""
        return None

    def _sync_grads(self) -> None:
        """Finish the models' grad syncs and make the grads the inner optimizer reads valid."""
        raise NotImplementedError

    def _device(self) -> torch.device:
        for group in self.inner.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def _ready_grads(self) -> bool:
        """Sync and unscale the grads, once per step; ``False`` if some rank's grads are not finite
        (only checked with a ``loss_scaler``)."""
        if not self._grads_ready:
            self._sync_grads()
            self._found_inf = False
            self._step_norm = None
            self._grads_as_synced = self.loss_scaler is None  # (unscaling scales this rank's grads only)
            if self.loss_scaler is not None:
                self._found_inf = unscale_and_check(self._local_grads(), float(self.loss_scaler.scale),
                                                    self.grad_norm_group, self._device())
            self._grads_ready = True
        return not self._found_inf

    @property
    def last_grad_norm(self) -> float | None:
        """The global grad norm (2-norm over every rank, before clipping) the last ``step()`` computed;
        ``None`` before the first step, or when none was computed (``on_nonfinite="unchecked"``
        without clipping). No collective: the step already all-reduced it."""
        return None if self._step_norm is None else float(self._step_norm)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every rank's grads to a global norm of ``max_norm``; return the global norm (float64; before
        clipping, after unscaling). A collective: call it on every rank, after ``backward()`` and
        before ``step()`` (or pass ``clip_grad=`` and let ``step()`` do it)."""
        self._ready_grads()
        total = self._global_norm(norm_type)
        self._clip(max_norm, total)
        self._step_norm = total
        return total

    def _global_norm(self, norm_type: float) -> torch.Tensor:
        """This step's global grad norm: from the whole grads where every rank holds them alike and
        nothing scaled them since the sync (no collective), else one all-reduce of the owned grads'."""
        whole = self._whole_grads() if self._grads_as_synced else None
        if whole is not None:
            return global_norm(whole, norm_type, device=self._device(), collective=False)
        return global_norm(self._owned_grads(), norm_type, self.grad_norm_group, device=self._device())

    def _clip(self, max_norm: float, total: torch.Tensor) -> None:
        clip_by_norm(self._local_grads(), max_norm, total)
        self._grads_as_synced = False  # this rank's grads clipped, the copies of others' it holds not

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the models' grad syncs, unscale (``loss_scaler``), clip (``clip_grad``) and step;
        a ``DistributedOptimizer`` then all-gathers the updated params. Skipped on inf/nan grads."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._begin_step():
            self._apply_step()
        return loss

    def _apply_step(self) -> None:
        self.inner.step()

    def _nonfinite_norm(self) -> None:
        """Raise or warn about this step's non-finite norm (``on_nonfinite``), on every rank alike."""
        self._grads_ready = False
        message = (f"the global grad norm is {float(self._step_norm)} (inf or nan grads on some rank); "
                   f"{type(self).__name__}(on_nonfinite={self.on_nonfinite!r})")
        if self.on_nonfinite == "raise":
            raise NonFiniteGradError(f"{message} refuses to step. Pass on_nonfinite='skip' to skip such steps "
                                     "with a warning, or use a loss_scaler for fp16")
        warnings.warn(f"{message} skipped this step on every rank; params, state and grads are left as they are",
                      RuntimeWarning, stacklevel=4)

    def _begin_step(self) -> bool:
        """Everything before the inner step: sync, unscale, overflow check, clip, non-finite norm
        check. ``False``: skip (the same answer on every rank: both checks are all-reduced)."""
        finite = self._ready_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(not finite)
        if finite:
            # the norm clipping needs anyway (without clip_grad, the one the user's clip_grad_norm() found
            # if called, else one scalar all-reduce), checked before clipping so a skipped step leaves
            # the grads as they were
            checked = self.on_nonfinite != "unchecked"
            if self.clip_grad > 0 or (checked and self._step_norm is None):
                self._step_norm = self._global_norm(2.0)
            finite = not checked or bool(torch.isfinite(self._step_norm))
            if finite and self.clip_grad > 0:
                self._clip(self.clip_grad, self._step_norm)
            elif not finite:
                self._nonfinite_norm()
        self.last_step_skipped = not finite
        self._grads_ready = False
        return finite
