"""Issue #39, round 2: "replicated means local", and plain tensors meeting the stream.

What ``get_plan("auto")`` does for the models beyond decoder LMs, each checked against one process
in float64 on 2 ranks (output, loss, every gradient, the parameters after an SGD step):

- a plain tensor the model computes or is given (pixel values, masks, rotary tables, an adapter's
  plain branch) that meets a DTensor is taken as ``Replicate`` at that op (``replicate_plain`` on the
  root): DeBERTa's relative positions, LoRA on Llama, a ViT's pixels;
- what runs before the stream with only replicated parameters (a conv stem, a patch embedding) runs on
  plain local tensors (``replicated_local``): a ViT, a wav2vec2-style feature extractor;
- a pooled classifier head's row-wise output is not (batch, seq, hidden): it stays whole under SP, so
  the model's output reaches the loss a plain tensor (ESM's classifier);
- a table shared by lookups and a head that cannot all be sharded is replicated for every use (one
  placement per parameter): BART's shared embedding and tied LM head.
"""

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from dmodule_auto_models import FLOAT32_INSIDE  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

from ndweave.dmodule import parallelize_module  # noqa: E402
from ndweave.dmodule.infer import derive  # noqa: E402
from ndweave.mesh import fake_world  # noqa: E402
from ndweave.mesh.testing import distributed  # noqa: E402

#: one model per cause the round fixed: (case, sequence_parallel, hand "auto" the batch's shapes)
CASES = {
    "image_cls/vit": (False, True),  # a conv patch embedding fed plain pixels
    "seq_cls/esm": (True, False),  # a pooled classifier head: its output whole under SP
    "masked_lm/deberta": (False, False),  # relative positions: plain tensors meeting the stream
    "peft/llama_lora": (False, False),  # rotary tables (plain) meeting the LoRA-wrapped projections' output
    "seq2seq/bart": (False, True),  # an embedding shared by encoder, decoder and the LM head
}


@distributed(world_size=2, timeout=300)
def _parity(case: str, sequence_parallel: bool, example_inputs: bool) -> None:
    from dmodule_any_models import check_any_parity

    check_any_parity(case, sequence_parallel=sequence_parallel, steps=1, tol=FLOAT32_INSIDE,
                     example_inputs=example_inputs)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_matches_one_process(case):
    if case.startswith("peft/"):
        pytest.importorskip("peft")
    _parity(case, *CASES[case])


class _Masked(nn.Module):
    """A linear whose output meets a plain tensor the forward makes (a mask, a position table)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * torch.arange(4.0)


def _root_patches(plan: dict) -> list:
    return plan["patch"].get("", [])


def test_auto_writes_replicate_plain_on_the_root():
    from ndweave.dmodule.plans import get_plan

    plan = get_plan("auto", _Masked(), example_inputs=((torch.zeros(2, 3, 4),), {}))
    assert "replicate_plain" in _root_patches(plan)


def test_a_plain_tensor_meeting_a_dtensor_is_taken_as_replicate():
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        model = parallelize_module(_Masked(), mesh, {"patch": {"": ["replicate_plain"]}}, use_local_output=False)
        out = model(torch.ones(2, 3, 4))
        assert isinstance(out, DTensor) and out.placements == (Replicate(),)


def test_replicate_plain_is_off_after_a_forward_that_needs_none():
    calls = []

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            calls.append(torch._C._is_torch_function_mode_enabled())
            return self.proj(x)

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        model = parallelize_module(Counting(), mesh, {"patch": {"": ["replicate_plain"]},
                                                      "forward": {"proj.input": [[Replicate()]]}})
        model(torch.ones(2, 4))
        model(torch.ones(2, 4))
    assert calls == [True, False]


def test_a_shared_table_gets_one_placement_for_every_use():
    from dmodule_any_models import batch_candidates, build_any

    model = build_any("seq2seq/bart")
    d = derive(model, example_inputs=((), batch_candidates("seq2seq/bart", model, 0)[0][0]))
    placements = {f"{e.module}.{e.leaf}": e.value for e in d.entries.items if e.section == "parameter"}
    tied = ["model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
            "lm_head.weight"]
    assert {repr(placements.get(n, [Replicate()])) for n in tied} == {repr([Replicate()])}
    assert not any(e.value in ("vocab_parallel_embedding", "vocab_parallel_forward") for e in d.entries.items)


def test_a_pooled_head_output_stays_whole_under_sp():
    from dmodule_any_models import build_any

    d = derive(build_any("seq_cls/esm"), sequence_parallel=True)
    out = d.entries.get("forward", "classifier.out_proj", "output")
    assert out is not None and out.value == [[Replicate()]]
    assert d.entries.get("forward", "esm.encoder.layer.0.output.dense", "output").value == [[Shard(1)]]
