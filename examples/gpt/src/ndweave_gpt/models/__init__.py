"""The job's models: :mod:`~ndweave_gpt.models.nanogpt` (a small GPT, the ``"nanogpt"`` plan's) and
:mod:`~ndweave_gpt.models.hf` (transformers models: their config, plan and weights)."""
