"""Any model, traced (``construct_pipeline_stage(..., example_inputs=)``): blocks as plain attributes
with the root forward's own work between them, layers taking several values the root computed once,
split at every layer boundary and by parameter count, under every schedule, train like one process
(float64 strict: losses, every grad of every step, the final parameters); forward-only evaluation
and generation through the pipeline equal one process."""

from __future__ import annotations

import copy

import pytest
import torch

from ndweave.mesh import init_device_mesh
from ndweave.mesh.testing import assert_close, distributed
from ndweave.pipeline import PipeEngine, PipelineParallelPlan, PipelineStageError, construct_pipeline_stage, generate
from pipeline_any_models import OTHER_LIBRARIES, AttrLM, ReusedLM, TupleLM
from pipeline_models import SEQ, TinyLM, assert_same_training, batches, loss_fn, train_pipeline, train_reference
from test_pipeline_faults import Faulty

STEPS = 3


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """The loss on one device: the model's logits (a dict's) against the targets."""
    return loss_fn(output["logits"] if isinstance(output, dict) else output, targets)


def _one_process(model_class):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = model_class()
    data = batches(STEPS, 8)
    return model, data, train_reference(model, data, loss=lm_loss)


@pytest.mark.parity
@distributed(world_size=2, timeout=300)
def test_blocks_as_attributes_split_at_every_boundary_match_one_process():
    model, data, expected = _one_process(AttrLM)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    example = data[0][0][:2]  # one micro-batch: only its shapes and dtypes are used
    for point in ["wpe", "block1", "block2", "block3", "block4", "norm", "head", None]:
        plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4, split_points=point and [point],
                                    activation_recompute=point is None)
        actual = train_pipeline(model, plan, mesh, data, loss=lm_loss, example_inputs=example)
        assert_same_training(actual, expected, f"AttrLM split at {point or 'uniform'}")
    # by measured time: each rank times the layers, the mean decides, so both cut the same stages
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4, split_method="time")
    actual = train_pipeline(model, plan, mesh, data, loss=lm_loss, example_inputs=example)
    assert_same_training(actual, expected, "AttrLM split by time")


@pytest.mark.parity
@pytest.mark.heavy
@distributed(world_size=4, timeout=400)
def test_every_schedule_on_models_without_layer_containers_and_multi_value_cuts():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("PP",))
    for model_class in (AttrLM, TupleLM):
        model, data, expected = _one_process(model_class)
        for schedule, virtual in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
                                  ("zero_bubble", 2)]:
            plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=4)
            actual = train_pipeline(model, plan, mesh, data, loss=lm_loss, example_inputs=data[0][0][:2])
            assert_same_training(actual, expected, f"{model_class.__name__} PP=4 {schedule} v={virtual}")


@pytest.mark.parity
@distributed(world_size=2, timeout=300)
def test_a_block_called_on_two_stages_and_a_weight_read_on_every_stage_train_like_one_process():
    """Each stage that uses them holds a copy (summed grads, equal values, as tied weights), instead
    of the cut being refused; V-shaped and looped schedules hold two stages' copies on one rank."""
    model, data, expected = _one_process(ReusedLM)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    for schedule, virtual, points in [("1f1b", 1, ["block2"]), ("1f1b", 1, None), ("interleaved_1f1b", 2, None),
                                      ("zbv_zero_bubble", 2, None)]:
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=4,
                                    split_points=points)
        actual = train_pipeline(model, plan, mesh, data, loss=lm_loss, example_inputs=data[0][0][:2])
        assert_same_training(actual, expected, f"ReusedLM {schedule} v={virtual} split at {points or 'uniform'}")


# ------------------------------------------------------------------ forward only: evaluation and generation
@pytest.mark.parity
@pytest.mark.parametrize("library", sorted(OTHER_LIBRARIES))
def test_decoders_written_with_other_libraries_train_like_one_process(library):
    """torch's own ``nn.TransformerEncoder`` (its forward checks ``isinstance(mask, Tensor)``),
    x-transformers (layers as ``[norm, block, residual]`` lists its forward unpacks; ``autocast`` on
    its tensors' device, which fails on meta) and litgpt (an ``nn.Identity`` made inside its forward),
    given one micro-batch: PP=2, 1F1B."""
    if library != "torch":
        pytest.importorskip(library)  # (test dependencies, not the package's)
    _other_library_parity(library)


@distributed(world_size=2, timeout=300)
def _other_library_parity(library: str) -> None:
    model, data, expected = _one_process(OTHER_LIBRARIES[library])
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=4)
    actual = train_pipeline(model, plan, mesh, data, loss=lm_loss, example_inputs=data[0][0][:2])
    assert_same_training(actual, expected, library)


@pytest.mark.parity
@distributed(world_size=2, timeout=300)
def test_evaluation_is_the_one_process_loss_and_logits_between_training_steps():
    model, data, _ = _one_process(AttrLM)
    (x, y), (vx, vy) = data[0], data[-1]  # a training batch and a validation batch
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    last = mesh["PP"].get_local_rank() == 1
    for schedule, virtual in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]:
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=4)
        module = construct_pipeline_stage(copy.deepcopy(model), plan, mesh, example_inputs=x[:2])
        engine = PipeEngine(module, mesh, lm_loss, plan)
        reference = copy.deepcopy(model)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (module, reference)]
        for step in range(2):
            what = f"{schedule} v={virtual} step {step}"
            with torch.no_grad():
                expected_logits = reference(vx)
            assert_close(engine.evaluate(vx, vy), lm_loss(expected_logits, vy), name=f"{what}: validation loss")
            logits = engine.evaluate(vx)
            if last:
                assert_close(logits, expected_logits, name=f"{what}: logits")
            else:
                assert logits is None
            assert all(p.grad is None or step for p in module.parameters()), "evaluation left grads"
            for optimizer in optimizers:
                optimizer.zero_grad()
            engine(x, y)
            lm_loss(reference(x), y).backward()
            for optimizer in optimizers:
                optimizer.step()
        with pytest.raises(ValueError, match=r"these inputs have shape \(4, 4\), the first evaluation's had \(8, 4\)"):
            engine.evaluate(vx[:4], vy[:4])


@pytest.mark.parity
@distributed(world_size=2, timeout=300)
def test_greedy_generation_through_the_pipeline_is_one_process_token_for_token():
    model, data, _ = _one_process(AttrLM)
    prompt = data[0][0][:3, :2]
    expected = _generate_one_process(model, prompt, 8)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    for schedule, virtual in [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv_zero_bubble", 2)]:
        plan = PipelineParallelPlan(schedule_type=schedule, virtual_chunks=virtual, num_microbatches=4)
        module = construct_pipeline_stage(copy.deepcopy(model), plan, mesh, example_inputs=data[0][0][:2])
        engine = PipeEngine(module, mesh, lm_loss, plan)
        tokens = generate(engine, prompt, 8, max_seq_len=SEQ)
        assert torch.equal(tokens, expected), f"{schedule}: {tokens.tolist()} != {expected.tolist()}"
    # sampling: the last stage draws with the generator, as one process would
    sampled = generate(engine, prompt, 8, max_seq_len=SEQ, temperature=0.8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sampled, _generate_one_process(model, prompt, 8, 0.8, torch.Generator().manual_seed(3)))


def _generate_one_process(model, prompt, new_tokens, temperature=0.0, generator=None):
    tokens = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            scores = model(tokens[:, -SEQ:])[:, -1, :]
            if temperature:
                nxt = torch.multinomial(torch.softmax(scores.double() / temperature, -1), 1, generator=generator)
            else:
                nxt = scores.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
    return tokens


@distributed(world_size=2, timeout=90)
def test_evaluation_and_generation_that_raise_on_one_stage_raise_on_both():
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("PP",))
    model, faulty = TinyLM(num_layers=4), Faulty()
    model.layers[3] = faulty
    plan = PipelineParallelPlan(schedule_type="1f1b", num_microbatches=2, split_points=["layers.2"])
    (x, y), = batches(1, 4)
    for name, run in [("evaluate", lambda engine: engine.evaluate(x, y)),
                      ("generate", lambda engine: generate(engine, x[:, :2], 3))]:
        engine = PipeEngine(construct_pipeline_stage(model, plan, mesh), mesh, loss_fn, plan)
        faulty.fail_in = "forward"
        with pytest.raises(PipelineStageError, match=r"failed on PP rank 1 \(rank 1\), in the forward of .*stage 1"
                                                     r".*in module layers.3.fc: RuntimeError: mat1 and mat2"):
            run(engine)
        faulty.fail_in = None
        with pytest.raises(PipelineStageError, match="an earlier step failed"):
            run(engine)
