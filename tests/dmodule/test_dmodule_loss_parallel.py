"""Loss parallelism with the zoo plans: ``get_plan(name, model, loss_parallel=True)`` leaves the
logits ``Shard(-1)`` over the vocabulary, and torch's ``loss_parallel()`` cross-entropy (loss and
backward inside it) trains exactly as one process does, the loss computed outside the model against
a plain target with ignored positions."""

import copy

import pytest
import torch
import torch.nn.functional as F
from dmodule_training import check_training_parity
from dmodule_zoo_models import build
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from ndweave.dmodule import parallelize_module
from ndweave.dmodule.plans import get_plan
from ndweave.mesh.testing import distributed

BATCH, SEQ, STEPS = 2, 8, 3


def _batches(vocab: int, ignore_index: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
        tokens[0, -3:] = ignore_index  # padding the loss must skip (a target, never an input id)
        batches.append(tokens)
    return batches


def _logits(net, ids):
    out = net(ids)
    return out[0] if isinstance(out, tuple) else out.logits


def _loss_outside(net, tokens):
    logits = _logits(net, tokens[:, :-1].clamp(min=0))
    if isinstance(logits, DTensor):  # the parallel model's logits: this rank's vocabulary columns
        assert logits.placements == (Shard(2),) and logits.to_local().shape[-1] < logits.shape[-1]
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())  # plain target, ignore_index -100


def _run(name, sequence_parallel=False, loss_fn=_loss_outside, ignore_index=-100, make_optimizer=None, **overrides):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    reference = build(name, **overrides)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    plan = get_plan(name, model, sequence_parallel=sequence_parallel, loss_parallel=True)
    model = parallelize_module(model, mesh, plan)
    kwargs = {} if make_optimizer is None else {"make_optimizer": make_optimizer}
    check_training_parity(model, reference, _batches(reference.config.vocab_size, ignore_index), loss_fn,
                          context=loss_parallel, **kwargs)


@pytest.mark.parity
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@distributed(world_size=2)
def test_nanogpt_loss_parallel_matches_one_process(sequence_parallel):
    # bias=False: a key bias has an exactly-zero true gradient, which AdamW would turn into noise steps
    _run("nanogpt", sequence_parallel, bias=False)


def _loss_inside(net, tokens):
    """The job's GPT's own loss (reshape(-1, vocab), ignore_index=-1), inside forward (tests/gpt_model.py)."""
    return net(tokens[:, :-1].clamp(min=0), tokens[:, 1:])[1]


@pytest.mark.parity
@distributed(world_size=2)
def test_nanogpt_own_loss_inside_forward_under_loss_parallel():
    _run("nanogpt", loss_fn=_loss_inside, ignore_index=-1, bias=False, tie_weights=False)


@pytest.mark.parity
@distributed(world_size=2)
def test_hf_llama_loss_parallel_matches_one_process():
    pytest.importorskip("transformers")
    _run("hf_llama", sequence_parallel=True)


@pytest.mark.parity
@distributed(world_size=2)
def test_hf_gpt2_loss_parallel_uneven_vocab_matches_one_process():
    pytest.importorskip("transformers")
    # vocab 50257: 25129 + 25128 columns. SGD: GPT-2's key bias (fused in c_attn) has an exactly-zero
    # true gradient that Adam would blow up
    _run("hf_gpt2", make_optimizer=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9))


def test_loss_parallel_needs_a_vocabulary():
    with pytest.raises(ValueError, match='plan "mlp": loss_parallel=True shards a language model'):
        get_plan("mlp", loss_parallel=True)
