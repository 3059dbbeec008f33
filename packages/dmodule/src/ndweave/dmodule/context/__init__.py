"""Context parallelism: one sequence split over a ``"CP"`` mesh dim, attention computed across it.

:class:`ContextParallel` cuts each sequence into ``2 * CP`` chunks and gives rank ``r`` chunks ``r``
and ``2 * CP - 1 - r`` (a head and a tail, so causal attention's work is even across ranks);
:mod:`~ndweave.dmodule.context.layout` holds that arithmetic. Inside ``with cp.attention():`` every
``F.scaled_dot_product_attention`` the model calls, and attention it writes by hand
(:mod:`~ndweave.dmodule.context.eager`), runs this rank's queries against the keys and values of the
whole sequence, gathered over CP (:mod:`~ndweave.dmodule.context.attention`,
:mod:`~ndweave.dmodule.context.exchange`); the masks come from global token positions, so norms, MLPs
and embeddings stay local and unchanged.
"""

from ndweave.dmodule.context.attention import ContextParallel
from ndweave.dmodule.context.exchange import ATTENTION_BREAK
from ndweave.dmodule.context.layout import ContextParallelError, SequenceLayout

__all__ = ["ATTENTION_BREAK", "ContextParallel", "ContextParallelError", "SequenceLayout"]
