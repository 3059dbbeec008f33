"""A GPT-job checkpoint of an ``hf:`` model as a transformers checkpoint folder, from any mesh the
job ran on: ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it (config.json and
safetensors shards with their index, the weights in the dtype they were trained in), and, given the
run's tokenizer, ``AutoTokenizer.from_pretrained(OUT)`` too.

    python -m ndweave_gpt.export_hf checkpoints/gpt hf-out                  # the newest complete step
    python -m ndweave_gpt.export_hf checkpoints/gpt/step_00000200 hf-out    # one step's folder
    python -m ndweave_gpt.export_hf checkpoints/gpt hf-out --tokenizer my-tokenizer   # with its tokenizer

``python -m ndweave_gpt --export-hf DIR`` does the same with the run's last checkpoint. One process, no process
group: ``ndweave.checkpoint.export`` reads one shard's tensors at a time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ndweave.checkpoint import CheckpointManager, export, load
from ndweave_gpt.models import hf

__all__ = ["export_hf", "main"]


def _step_folder(checkpoint: Path) -> Path:
    """``checkpoint`` if it is one checkpoint, else the newest complete one in a --checkpoint-dir."""
    manager = CheckpointManager(checkpoint)
    latest = manager.latest() if checkpoint.is_dir() else None
    return checkpoint if latest is None else Path(manager.path(latest))


def export_hf(checkpoint: str | Path, out: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Write the model of ``checkpoint`` (a step folder, or the newest in a --checkpoint-dir) and its
    transformers config to the folder ``out``, with the tokenizer of the folder ``tokenizer`` (the run's
    ``--tokenizer``) where given; returns ``out``."""
    folder = _step_folder(Path(checkpoint))
    state = {"hf_config": ""}
    load(folder, state, strict=False)  # the config the run trained, kept in its checkpoints
    if not state["hf_config"]:
        raise SystemExit(f"error: {folder} holds no transformers config: it is a nanogpt run's checkpoint "
                         "(export it as a torch file with ndweave.checkpoint.export)")
    out = export(folder, out, format="safetensors")
    hf.config_from_json(state["hf_config"]).save_pretrained(out)
    if tokenizer:  # (as transformers writes it: the fine-tuned model and its tokenizer load from one folder)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ndweave_gpt.export_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step folder of the GPT job, or its --checkpoint-dir (the newest step)")
    p.add_argument("out", help="the transformers checkpoint folder to write")
    p.add_argument("--tokenizer", metavar="DIR", help="the run's tokenizer folder, saved beside the model")
    args = p.parse_args(argv)
    print(f"exported {export_hf(args.checkpoint, args.out, args.tokenizer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
