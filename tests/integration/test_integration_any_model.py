"""get_plan("auto") on the models users bring beyond decoder LMs composes with DDP and ZeRO (issue
#39): one model of each kind (an encoder classifier, an encoder-decoder, a vision classifier, CLIP, a
diffusion transformer, LoRA adapters on a decoder) on DP=2 x TP=2 with sequence parallelism, DDP laid
out for DistributedOptimizer (AdamW, ZeRO-1), trains like one process: the losses and the parameters
after AdamW steps, the loss computed outside the model against plain targets. Adapters: only they
train, and the frozen base holds no gradient buffer."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dmodule.dmodule_any_models import batch_candidates, build_any, loss_of, output_of  # noqa: E402
from dmodule.dmodule_auto_models import FLOAT32_INSIDE  # noqa: E402

from ndweave.ddp import DistributedDataParallel as DDP  # noqa: E402
from ndweave.dmodule import get_plan, parallelize_module  # noqa: E402
from ndweave.mesh import DEVICE_MESH  # noqa: E402
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed  # noqa: E402
from ndweave.optim import DistributedOptimizer  # noqa: E402

STEPS = 3
#: one model per kind; CI runs the first two, the rest are heavy
KINDS = {"lora": "peft/llama_lora", "vision": "image_cls/vit", "encoder": "seq_cls/roberta",
         "encoder-decoder": "seq2seq/t5", "contrastive": "contrastive/clip", "diffusion": "diffusion/dit"}


def _halves(case: str, inputs: dict, target: torch.Tensor) -> list[tuple[dict, torch.Tensor]]:
    """The batch as the two data-parallel ranks take it: every tensor cut in two along dim 0 (a
    contrastive target is each half's own image-text pairing, ``arange``)."""
    def cut(x, i):
        return x.chunk(2)[i] if isinstance(x, torch.Tensor) and x.dim() else x
    halves = [({k: cut(v, i) for k, v in inputs.items()}, cut(target, i)) for i in range(2)]
    if case.startswith("contrastive/"):
        halves = [(half, torch.arange(len(t))) for half, t in halves]
    return halves


def _loss(case: str, model, inputs: dict, target: torch.Tensor) -> torch.Tensor:
    return loss_of(case, output_of(case, model(**inputs)), target)


def _check(case: str) -> None:
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    reference = build_any(case).eval()  # eval: no dropout, whatever the config calls it
    DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    model = copy.deepcopy(reference)
    model = parallelize_module(model, DEVICE_MESH["TP"], get_plan("auto", model, sequence_parallel=True))
    model = DDP(model, DEVICE_MESH["DP"], use_distributed_optimizer=True, bucket_size=20_000)
    kwargs = {"lr": 1e-2, "eps": 1e-4, "foreach": False}  # (eps: see test_integration_auto)
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=[model], optimizer_kwargs=kwargs)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ref_optimizer = torch.optim.AdamW(trainable, **kwargs)
    dp_rank = DEVICE_MESH.get_data_parallel_rank()
    for step in range(STEPS):
        halves = _halves(case, *batch_candidates(case, reference, step)[0])
        ref_optimizer.zero_grad()
        # one process: the mean of the two halves' losses, the mean DDP's averaged grads stand for
        ref_loss = sum(_loss(case, reference, *half) for half in halves) / 2
        ref_loss.backward()
        ref_optimizer.step()
        optimizer.zero_grad()
        loss = _loss(case, model, *halves[dp_rank])
        loss.backward()
        optimizer.step()
        value = loss.detach().reshape(1).clone()
        dist.all_reduce(value, group=DEVICE_MESH.get_data_parallel_group())
        assert_close(value[0] / 2, ref_loss.detach(), name=f"{case} step {step} loss", tol=FLOAT32_INSIDE)
    for (fqn, p), (_, q) in zip(reference.named_parameters(), model.module.named_parameters()):
        assert_close(q, p, name=f"{case} {fqn} after {STEPS} AdamW steps", tol=FLOAT32_INSIDE)
    bucketed = {entry.name for bucket in model.grad_buckets() for entry in bucket.params}
    assert bucketed == {n for n, p in model.module.named_parameters() if p.requires_grad}, \
        f"{case}: DDP buckets {len(bucketed)} parameters, not exactly the trainable ones"


@pytest.mark.parity
@pytest.mark.parametrize("kind", list(KINDS)[:2])
@distributed(world_size=4, timeout=300)
def test_each_kind_trains_on_dp_tp_sp_with_zero_adamw_like_one_process(kind):
    _check(KINDS[kind])


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.parametrize("kind", list(KINDS)[2:])
@distributed(world_size=4, timeout=300)
def test_more_kinds_train_on_dp_tp_sp_with_zero_adamw_like_one_process(kind):
    _check(KINDS[kind])
