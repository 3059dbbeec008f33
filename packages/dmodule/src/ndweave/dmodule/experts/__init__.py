"""Expert parallelism: experts divided over an ``EP`` mesh dim (:mod:`~ndweave.dmodule.experts.parallel`:
``parallelize_experts`` and the ``"expert_parallel"`` patch), tokens moved to them and back
(:mod:`~ndweave.dmodule.experts.dispatch`)."""
