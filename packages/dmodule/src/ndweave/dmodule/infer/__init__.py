"""Automatic tensor / sequence-parallel plans: ``get_plan("auto", model)`` and ``explain_plan``.

See ``auto.py`` for the steps and the dmodule README's *Automatic plans* for what it finds and what
it cannot do.
"""

from ndweave.dmodule.infer.auto import Derivation, auto_plan, derive, guess_inputs
from ndweave.dmodule.infer.explain import explain_plan

__all__ = ["Derivation", "auto_plan", "derive", "explain_plan", "guess_inputs"]
