"""The job as an installed package (``ndweave-gpt``): its data inside it, its flags from its config
dataclasses, and the tests' copy of its model the same as its own."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import gpt_model
import ndweave_gpt
from ndweave_gpt import config
from ndweave_gpt.models import nanogpt

ROOT = Path(__file__).resolve().parents[2]


def test_the_tests_copy_of_the_gpt_is_the_jobs():
    """The dmodule and pipeline suites run without the job installed: they build its GPT from
    ``tests/gpt_model.py``, which must stay the job's own file."""
    assert Path(gpt_model.__file__).read_text() == Path(nanogpt.__file__).read_text(), (
        "tests/gpt_model.py differs from ndweave_gpt/models/nanogpt.py: copy the job's model over it")


def test_the_corpus_and_configs_are_package_data():
    files = resources.files(ndweave_gpt)
    assert (files / "data" / "shakespeare.txt").is_file() and (files / "data" / "README.md").is_file()
    assert (files / "configs" / "llama3_8b.json").is_file()


def test_every_flag_is_a_field_with_its_docstring_and_default():
    parser = config.build_parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    fields = {f.name: (cls, f) for cls in config._CLASSES.values() for f in dataclasses.fields(cls)}
    assert set(flags) == set(fields) - {"hf_config"}
    for name, action in flags.items():
        cls, f = fields[name]
        assert action.default == f.default and action.help == config.field_docs(cls)[name], name
    defaults = config.parse_args([])
    assert defaults == config.JobConfig() and json.loads(defaults.to_json())["parallel"]["mesh"] == "pp=2,dp=2,tp=2"
    assert defaults.replace(mesh="dp=4", n_layer=2).parallel.mesh == "dp=4"


def test_the_module_entry_points_answer_help():
    for module in ("ndweave_gpt", "ndweave_gpt.export_hf"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_nothing_imports_by_path():
    """The job, the tests and the benchmarks import the job as a package, never by a path put on the
    module search path."""
    search_path = ".".join(("sys", "path"))  # (not one literal: this file is no offender)
    offenders = [p for folder in ("examples", "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py")
                 if search_path in p.read_text()]
    assert not offenders, offenders


def test_the_seeds_loop_on_the_example_gpt_says_what_to_unpack():
    """Seed 000's loop verbatim (``loss = model(X, Y); loss.backward()``) meets the GPT's ``(logits,
    loss)``: the error says how to unpack it, not "'tuple' object has no attribute 'backward'"; the
    unpacked loss trains."""
    import pytest
    import torch

    model = nanogpt.GPT(nanogpt.GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16))
    X = Y = torch.randint(0, 256, (2, 16))
    loss = model(X, Y)
    with pytest.raises(AttributeError, match=r"GPT returns \(logits, loss\), not the loss alone: unpack it, "
                                             r"`logits, loss = model\(x, y\)`, then use `loss.backward`"):
        loss.backward()
    logits, loss = model(X, Y)
    loss.backward()
    assert logits.shape == (2, 16, 256) and model.lm_head.weight.grad is not None
