"""ndweave's main job: a GPT (or a transformers model) trained on Shakespeare's bytes (or your data,
``--data``) with pipeline x data x expert x tensor(+sequence) parallelism and a ZeRO optimizer over one
device mesh, checkpointed, resumable on any other mesh. ``python -m ndweave_gpt --help`` lists its flags
(:mod:`ndweave_gpt.config`).

The modules, one per concern: :mod:`~ndweave_gpt.config` (the flags, as frozen dataclasses),
:mod:`~ndweave_gpt.build` (mesh, model, parallelize, optimizer), :mod:`~ndweave_gpt.state`
(checkpoint and resume), :mod:`~ndweave_gpt.loop` (the training loop), :mod:`~ndweave_gpt.evaluate`,
:mod:`~ndweave_gpt.metrics`, :mod:`~ndweave_gpt.reference` (the one-process run), ``models/``,
:mod:`~ndweave_gpt.data`, and ``cost/`` (``--estimate`` and ``--mesh auto``).
"""

__version__ = "0.5.1"
__all__ = ["__version__"]
