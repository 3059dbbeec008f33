"""Real transformers models of several kinds through the traced pipeline with several inputs given
as keyword arguments (``engine({"input_ids": ids, "attention_mask": mask}, targets)``), trained at
PP=2 like one process (float64 strict: losses, every grad of every step, the final parameters):
encoder classifiers, a vision classifier, encoder-decoders cut between their two stacks, CLIP,
diffusers' DiT, PEFT LoRA adapters on a Llama. (In the integration tests: their environment has
transformers, diffusers and PEFT; the pipeline's own has x-transformers and litgpt, whose
huggingface-hub pin transformers 5 cannot share.)"""

from __future__ import annotations

import copy

import pytest
import torch

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import assert_close, distributed
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, construct_pipeline_stage
from ndweave.pipeline.construct import cut_model
from ndweave.pipeline.plan import resolve_plan
from pipeline_kinds import TRACE_KEYWORDS, kind_run, train_one_process_kwargs, train_pipeline_kwargs
from pipeline.pipeline_models import assert_same_training

pytest.importorskip("transformers")  # (a test dependency, not the package's)


def _parity(name: str, split_points=None) -> None:
    model, data, loss = kind_run(name)
    # CLIP's loss contrasts the pairs of one micro-batch: one process takes it over the same parts
    expected = train_one_process_kwargs(model, data, loss, micro_batches=4 if name == "clip" else 1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4, split_points=split_points)
    actual = train_pipeline_kwargs(model, plan, mesh, data, loss, fixed=TRACE_KEYWORDS.get(name))
    assert_same_training(actual, expected, f"{name} split at {split_points or 'uniform'}")


@pytest.mark.parity
@distributed(world_size=2, timeout=300)
def test_bert_with_input_ids_and_attention_mask_as_keywords_trains_like_one_process():
    _parity("bert")


@pytest.mark.parity
@pytest.mark.parametrize("name", ["roberta", "esm", "deberta_v2", "modernbert", "vit", "t5", "bart", "clip"])
def test_kind_trains_like_one_process(name):
    """Encoder classifiers (DeBERTa-v2's relative embeddings are read by the layers of both stages:
    each stage holds a copy, kept equal as tied weights are), ViT on pixel values, T5 and BART on input
    ids and decoder input ids (cut between their encoder and decoder), CLIP on input ids and pixel
    values (its vision tower on one stage, its text tower on the other)."""
    _distributed_parity(name)


@pytest.mark.parity
@pytest.mark.parametrize(("name", "point"), [("t5", "encoder.block.1"), ("t5", "decoder.block.1"),
                                             ("bart", "model.encoder.layers.1"), ("bart", "model.decoder.layers.1")])
def test_encoder_decoders_cut_inside_either_stack_train_like_one_process(name, point):
    """A cut inside the encoder sends the decoder's inputs on with the encoder's hidden states; one
    inside the decoder sends the encoder's output on: the layers of both stacks, in the order the
    forward runs them, are the places to cut."""
    _distributed_parity(name, point)


@pytest.mark.parity
def test_a_peft_lora_llama_trains_its_adapters_like_one_process():
    """The adapters train, the base stays frozen; traced with ``use_cache=False`` (a cache object
    would cross the cut). PEFT is a test dependency of other packages' tests: absent, this skips."""
    pytest.importorskip("peft")
    _distributed_parity("lora_llama")


@pytest.mark.parity
def test_a_diffusion_transformer_with_timesteps_and_labels_trains_like_one_process():
    """diffusers' DiT: three inputs (latents, timesteps, class labels), the conditioning embedded once
    and read by the blocks of both stages."""
    pytest.importorskip("diffusers")
    _distributed_parity("dit")


@distributed(world_size=2, timeout=300)
def _distributed_parity(name: str, point: str | None = None) -> None:
    _parity(name, point and [point])


@pytest.mark.parity
@distributed(world_size=2, timeout=300)
def test_positional_inputs_and_evaluation_with_keyword_inputs():
    """The same model given its inputs as a tuple (positional), and evaluated with a dict: the one
    process loss and logits."""
    model, data, loss = kind_run("bert")
    expected = train_one_process_kwargs(model, data, loss)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4)
    positional = [((x["input_ids"], x["attention_mask"]), y) for x, y in data]
    module = construct_pipeline_stage(copy.deepcopy(model), plan, mesh,
                                      example_inputs=tuple(t[:2] for t in positional[0][0]))
    engine = PipeEngine(module, mesh, loss, plan)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.05)  # (as the one process's)
    for step, ((x, y), ref_loss) in enumerate(zip(positional, expected[0])):
        optimizer.zero_grad()
        assert_close(engine(x, y), ref_loss, name=f"positional inputs: loss of step {step}")
        optimizer.step()
    (x, y), last = data[1], mesh["PP"].get_local_rank() == 1
    trained = copy.deepcopy(model)  # as far as the pipeline
    trained.load_state_dict(expected[2], strict=False)
    with torch.no_grad():
        reference = trained(**x).logits
    assert_close(engine.evaluate(x, y), loss(reference, y), name="evaluation loss with keyword inputs")
    logits = engine.evaluate(x)
    assert (logits is None) != last
    if last:
        assert_close(logits, reference, name="evaluation logits")


@distributed(world_size=2, timeout=120)
def test_a_batch_with_other_inputs_than_the_first_is_refused_on_every_pp_rank():
    model, data, loss = kind_run("bert")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4)
    (x, y), first = data[0], mesh["PP"].get_local_rank() == 0
    module = construct_pipeline_stage(model, plan, mesh, example_inputs={k: v[:2] for k, v in x.items()})
    engine = PipeEngine(module, mesh, loss, plan)
    ids, mask = x["input_ids"], x["attention_mask"]
    refusals = [  # what the first stage holds, the refusal every PP rank raises
        ({"input_ids": ids, "attention_mask": mask[:4]},
         r"input 'attention_mask' has 4 samples along dim 0, but 'input_ids' has 8; .*give each the same samples"),
        ({"input_ids": ids, "attention_mask": mask.tolist()}, r"input 'attention_mask' must be a tensor"),
        ({"input_ids": ids, "attention_mask": mask, "token_type_ids": mask},
         (r"the first stage was traced with the inputs \['input_ids', 'attention_mask'\]; this batch has "
          r"\['token_type_ids'\], which the trace did not take")),
    ]
    for inputs, message in refusals:
        with pytest.raises(ValueError, match=r"refused on PP rank 0: " + message):
            engine(inputs if first else None, None if first else y)
    assert torch.isfinite(engine(x, y))
    later = [
        ({"input_ids": ids}, (r"the first stage was traced with the inputs \['input_ids', 'attention_mask'\]; "
                              r"this batch lacks \['attention_mask'\]")),
        ({"attention_mask": mask, "input_ids": ids}, (r"this batch's inputs are \['attention_mask', 'input_ids'\], "
                                                      r"the first step's were \['input_ids', 'attention_mask'\]")),
        ({"input_ids": ids, "attention_mask": mask[:, :4]},
         r"input 'attention_mask' has shape \(8, 4\), the first step's had \(8, 6\)"),
    ]
    for inputs, message in later:
        with pytest.raises(ValueError, match=r"refused on PP rank 0: " + message):
            engine(inputs if first else None, None if first else y)
    assert torch.isfinite(engine(x, y))  # the engine still runs after refused steps
    with pytest.raises(ValueError, match=r"evaluate refused on PP rank 0: the first stage was traced with the inputs "
                                         r"\['input_ids', 'attention_mask'\]; this batch lacks"):
        engine.evaluate({"input_ids": ids} if first else None, None if first else y)
    assert torch.isfinite(engine.evaluate(x, y))


def test_an_encoder_decoder_traced_with_its_cache_is_told_to_pass_use_cache_false():
    """T5 builds a cache object to hand its layers, which no stage could send on: the trace says so."""
    dtype = torch.get_default_dtype()
    try:
        model, data, _ = kind_run("t5")
    finally:
        torch.set_default_dtype(dtype)
    plan = PipelineParallelPlan(num_microbatches=4)
    example = {k: v[:2] for k, v in data[0][0].items()}
    with pytest.raises(NotImplementedError, match=r"EncoderDecoderCache.*\(HF models: use_cache=False\)"):
        cut_model(model, plan, resolve_plan(plan, 2), example, "meta")
    cut_model(model, plan, resolve_plan(plan, 2), {**example, "use_cache": False}, "meta")
