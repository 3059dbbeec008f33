"""Cutting a traced model, on one process: stages in execution order, the values crossing each cut
(``StageIO``), chunks that are still the user's class with original FQNs, split points inside a
layer, and the errors for forwards that cannot be cut where asked."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from ndweave.mesh import init_device_mesh
from ndweave.mesh import fake_world
from ndweave.pipeline import PipelineParallelPlan, SharedParam, StagePlaceholder, construct_pipeline_stage
from pipeline_any_models import OTHER_LIBRARIES, AttrLM, TupleLM
from pipeline_models import SEQ, VOCAB, WIDTH, Block, TinyLM

IDS = torch.zeros(2, SEQ, dtype=torch.long)  # an example micro-batch: only shape and dtype matter


def _stages(model: nn.Module, pp: int, example=IDS, **plan):
    """Every PP rank's PipeModule of ``model`` (one process, a fake world per rank)."""
    stages = []
    for rank in range(pp):
        with fake_world(pp, rank=rank):
            mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("PP",))
            stages.append(construct_pipeline_stage(model, PipelineParallelPlan(schedule_type="gpipe", **plan), mesh,
                                                   example_inputs=example))
    return stages


def test_stages_follow_execution_order_and_say_what_crosses_each_cut():
    stages = _stages(TupleLM(num_layers=2), 2, split_points=["layers.1"])
    # the rotary table runs before the embedding: execution order, not registration order
    assert stages[0].stage_layers == [["rotary", "wte", "layers.0"], ["layers.1", "head"]]
    io = stages[1].stage_io[1]
    assert [(v.name, v.kinds) for v in io.values] == [
        ("expand", ("tensor",)), ("tril", ("tensor",)), ("rotary", ("tensor", "tensor")), ("layers_0", ("tensor",))]
    assert io.num_tensors == 5 and stages[0].stage_io[0] is None
    assert "rotary (the output of 'rotary'" in str(io)


def test_traced_chunks_are_the_users_class_and_own_what_their_stage_runs():
    torch.manual_seed(0)
    model = AttrLM()
    stages = _stages(model, 2, split_points=["block3"])
    first, second = (s[0] for s in stages)
    assert isinstance(first, AttrLM) and isinstance(second.block1, StagePlaceholder)
    assert [n for n, _ in second.named_parameters()] == [
        *(f"block{i}.{p}" for i in (3, 4) for p in ("norm.weight", "norm.bias", "fc.weight", "fc.bias",
                                                      "proj.weight", "proj.bias")),
        "norm.weight", "norm.bias", "head.weight"]
    assert "scale" in dict(first.named_parameters())  # the root's own weight: the stage that reads it
    assert stages[0].shared_params == [SharedParam(("wte.weight", "head.weight"), (0, 1))]
    # the batch's sizes cross as ints, the skip connection as a second tensor
    assert [v.kinds for v in stages[1].stage_io[1].values] == [("int",), ("int",), ("tensor",)]
    x = IDS.random_(0, VOCAB)
    torch.testing.assert_close(second(*first(x)), model(x))
    assert "block3" in stages[1].chunks[0]._pipeline_stage_program.code()


def test_a_split_point_inside_a_layer_opens_it():
    torch.manual_seed(0)
    model = AttrLM()
    stages = _stages(model, 2, split_points=["block2.proj"])
    assert stages[0].stage_layers[0][-2:] == ["block2.norm", "block2.fc"]
    assert stages[1].stage_layers[1][0] == "block2.proj"
    x = IDS.random_(0, VOCAB)
    torch.testing.assert_close(stages[1][0](*stages[0][0](x)), model(x))


def test_meta_model_traced_on_meta_inputs_materializes_one_stage():
    torch.manual_seed(0)
    reference = AttrLM()
    with torch.device("meta"):
        model = AttrLM()
    stage = _stages(model, 2, example=IDS.to("meta"), split_points=["block3"])[1]
    stage[0].to_empty(device="cpu")
    stage.load_state_dict(reference.state_dict())
    others = [p for n, p in model.named_parameters() if n.startswith(("block1.", "block2."))]
    assert others and all(p.is_meta for p in others)
    for name, param in stage.named_parameters():
        assert torch.equal(param, reference.get_parameter(name)), name


class ScaledLM(nn.Module):
    """Computes a Python float from the sequence length after its first block and uses it at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.block1, self.block2, self.head = nn.Embedding(VOCAB, WIDTH), Block(), Block(), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        h = self.block1(self.wte(idx))
        temperature = math.sqrt(h.shape[1])
        return self.head(self.block2(h)) / temperature


class ReuseLM(nn.Module):
    """Calls one block twice, with another in between."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.block1, self.block2 = nn.Embedding(VOCAB, WIDTH), Block(), Block()

    def forward(self, idx):
        return self.block1(self.block2(self.block1(self.wte(idx))))


class SharedScaleLM(nn.Module):
    """Reads its own weight after each of two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.block1, self.block2 = nn.Embedding(VOCAB, WIDTH), Block(), Block()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, idx):
        return self.block2(self.block1(self.wte(idx)) * self.scale) * self.scale


class FunctionalHeadLM(nn.Module):
    """Ties its head to the embedding by reading the embedding's weight in the root forward."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.block1, self.block2 = nn.Embedding(VOCAB, WIDTH), Block(), Block()

    def forward(self, idx):
        return self.block2(self.block1(self.wte(idx))) @ self.wte.weight.T


def test_forwards_that_cannot_be_cut_there_name_the_value_and_a_split_that_works():
    with pytest.raises(ValueError, match=r"cannot be cut before 'head': sqrt \(math.sqrt; test_pipeline_any_plan.py:\d+ "
                                         r"`temperature = math.sqrt\(h.shape\[1\]\)`\) is needed after the cut and holds "
                                         r"a float.*the nearest split point that works: 'block1'"):
        _stages(ScaledLM(), 2, split_points=["head"])
    assert _stages(ScaledLM(), 2)[0].stage_layers == [["wte"], ["block1", "block2", "head"]]  # uniform: cuts that work
    # a layer called on two stages, a weight of the root's read on two, a layer's weight the root reads
    # on another stage: each stage that uses it holds it, as a weight shared across stages
    for model, names in [(ReuseLM(), ["block1.fc.weight", "block1.norm.weight"]), (SharedScaleLM(), ["scale"]),
                         (FunctionalHeadLM(), ["wte.weight"])]:
        stages = _stages(model, 2, split_points=["block2"])
        shared = {sp.fqns[0]: sp.stages for sp in stages[0].shared_params}
        assert all(shared[name] == (0, 1) for name in names), (type(model).__name__, shared)
        for stage in stages:  # each stage's chunk holds its copy, under the model's names
            assert set(names) <= {n for n, _ in stage.named_parameters()}, type(model).__name__
    with pytest.raises(ValueError, match=r"'block9' names no module of AttrLM; nearest FQNs: \['block4', 'block3'"):
        _stages(AttrLM(), 2, split_points=["block9"])
    with pytest.raises(ValueError, match=r"'block2' runs before 'block3'"):
        _stages(AttrLM(), 3, split_points=["block3", "block2"])


def test_without_example_inputs_a_model_without_containers_is_told_to_trace():
    """Told at construction, with what stopped the shape-free cut (here: fx meets the ``assert`` on a
    traced size), never later inside a stage's forward."""
    with pytest.raises(ValueError, match=r"has no ModuleList.*cannot be cut without shapes \(a symbolic trace stops "
                                         r"at TraceError.*\); pass example_inputs= \(one micro-batch\) to "
                                         r"construct_pipeline_stage"):
        _stages(AttrLM(), 2, example=None)
    assert _stages(TinyLM(num_layers=2), 2, example=None)[1].stage_io == [None, None]  # the skeleton path


def test_without_example_inputs_a_forward_that_reads_its_input_as_ids_is_refused_at_construction():
    """nanoGPT's forward adds position embeddings of ``idx``'s length to the token ones: cut without shapes,
    stage 1 would read hidden states as ids there and fail inside its first forward (x-transformers and
    litgpt likewise).
    Tried at construction on fake tensors, it is refused there, naming the line and the fix."""
    from gpt_model import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=WIDTH))
    with pytest.raises(ValueError, match=r"GPT cannot be pipelined without example_inputs: .* stage 1 runs the "
                                         r"model's whole forward .*fails on what stage 0 hands it \(RuntimeError: .* at "
                                         r".*gpt_model.py:\d+\); pass example_inputs= \(one micro-batch\)"):
        _stages(model, 2, example=None)
    assert _stages(model, 2)[1].stage_io[1] is not None  # with them: the traced cut


@pytest.mark.parametrize("library", ["torch", "x_transformers", "litgpt"])
def test_without_example_inputs_decoders_of_other_libraries_are_refused_at_construction(library):
    """Told at construction (before: x-transformers stopped in stage 0's forward at 'cannot unpack
    non-iterable', litgpt in stage 1's at a shape error, torch's at a missing 'self_attn')."""
    if library != "torch":
        pytest.importorskip(library)  # (test dependencies, not the package's)
    model = OTHER_LIBRARIES[library]()
    with pytest.raises(ValueError, match=r"cannot be pipelined without example_inputs: .* fails on (the model's "
                                         r"input|what stage 0 hands it) \(\w+: .*\); pass example_inputs="):
        _stages(model, 2, example=None)


class Chained(nn.Module):
    """Layers as plain attributes, chained (veScale's ``EightMLP``); ``skip`` feeds a layer two values."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h.retain_grad()  # a side effect between layers: it runs on the stage that computed h
        h = self.second(h)
        return self.third(h + x if self.skip else h)


def test_without_example_inputs_a_chain_of_plain_attributes_is_cut_in_call_order():
    """As veScale cuts it (a symbolic trace, no shapes): each stage runs from its first layer on, so a
    chunk called alone computes only its layers; a forward that is not a chain is told to trace."""
    torch.manual_seed(0)
    model = Chained()
    stages = _stages(model, 3, example=None)
    assert [s.stage_layers for s in stages][0] == [["first"], ["second"], ["third"]]
    x = torch.randn(2, WIDTH)
    assert torch.equal(stages[1][0](x), model.second(x)) and torch.equal(stages[2][0](x), model.third(x))
    assert torch.equal(stages[0][0](x), model.first(x))
    with pytest.raises(ValueError, match=r"cannot be cut without shapes \('third' is not called on the previous "
                                         r"layer's output alone\)"):
        _stages(Chained(skip=True), 3, example=None)


class SlowBlock(nn.Module):
    """Few parameters, much compute: one small matmul repeated."""

    def __init__(self, repeats: int) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.repeats = repeats

    def forward(self, x):
        for _ in range(self.repeats):
            x = torch.tanh(self.fc(x))
        return x


class Unbalanced(nn.Module):
    """A large embedding and three small quick blocks, then a small block that takes most of the time."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, WIDTH)
        self.quick1, self.quick2, self.quick3 = SlowBlock(1), SlowBlock(1), SlowBlock(1)
        self.slow = SlowBlock(1000)  # (well above the embedding's dense backward, ~4 ms here)

    def forward(self, idx):
        return self.slow(self.quick3(self.quick2(self.quick1(self.embed(idx)))))


def test_split_by_measured_time_balances_what_parameter_counts_cannot():
    model = Unbalanced()
    by_params = _stages(model, 2)[0]
    assert by_params.stage_layers == [["embed"], ["quick1", "quick2", "quick3", "slow"]]
    assert by_params.stage_seconds is None
    by_time = _stages(model, 2, split_method="time")[0]
    assert by_time.stage_layers == [["embed", "quick1", "quick2", "quick3"], ["slow"]], by_time.stage_seconds
    assert all(p.grad is None for p in model.parameters())  # timing left no grads behind
    with pytest.raises(ValueError, match="split_method='time' runs the layers on the example: pass real"):
        _stages(model, 2, example=IDS.to("meta"), split_method="time")
    with pytest.raises(ValueError, match="'time' times the layers of the traced forward: pass example_inputs="):
        _stages(model, 2, example=None, split_method="time")


def test_cutting_a_model_imports_no_compiler():
    # fx's own stack-trace filter imports torch._dynamo, torch.export and inductor to list their files
    # (0.4-0.5 s in a fresh process); the tracer records the user's frames itself
    script = ("import sys, torch\n"
              "from pipeline_models import SEQ, TinyLM\n"
              "from ndweave.pipeline import PipelineParallelPlan\n"
              "from ndweave.pipeline.construct import cut_model\n"
              "from ndweave.pipeline.plan import resolve_plan\n"
              "plan = PipelineParallelPlan(schedule_type='gpipe')\n"
              "cut_model(TinyLM(), plan, resolve_plan(plan, 2), torch.zeros(2, SEQ, dtype=torch.long), 'meta')\n"
              "print(sorted(m for m in ('torch.export._trace', 'torch._inductor.codecache') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(__file__), check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
