"""Expert parallelism: experts split over an ``EP`` mesh dim, tokens moved to them and back
(:mod:`~ndweave.dmodule.experts.dispatch`)."""
