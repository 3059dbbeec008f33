"""LoRA adapters under ``get_plan("auto")`` (issue #39): the frozen base is sharded exactly as without the
adapter, each adapter follows its base (down projection replicated beside a column-wise base, up
projection replicated after a row-wise one), so a training step makes the collectives the base model's
makes, counted with torch's ``CommDebugMode``: no more in the forward and in the backward; the
adapters' partial gradients are summed by ``finish_grad_sync()`` in its one bucketed all-reduce."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dmodule_any_models import batch_candidates, check_any_parity, loss_of, output_of  # noqa: E402
from dmodule_auto_models import FLOAT32_INSIDE, build_hf  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

from ndweave.mesh.testing import STRICT_DTYPE, distributed  # noqa: E402

#: a column-wise and a row-wise base of each family, and the placements auto gives the base and the adapter
LAYOUTS = {
    "llama": {"model.layers.0.self_attn.q_proj": (Shard(0), Replicate(), Shard(0)),   # base, A, B
              "model.layers.0.mlp.down_proj": (Shard(1), Shard(1), Replicate())},
    "gpt2": {"transformer.h.0.mlp.c_fc": (Shard(1), Replicate(), Shard(0)),           # (Conv1D: (in, out))
             "transformer.h.0.mlp.c_proj": (Shard(0), Shard(1), Replicate())},
}


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _step_comms(model: torch.nn.Module, case: str, sequence_parallel: bool) -> dict[str, dict[str, int]]:
    """The collectives of a training step (the second) of ``model`` under the auto plan, by phase."""
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("TP",))
    model = parallelize_module(model, mesh, get_plan("auto", model, sequence_parallel=sequence_parallel))
    inputs, target = batch_candidates(case, model, 0)[0]
    # a first step: DModule's first call of each module agrees on shapes across ranks (counted once)
    loss_of(case, output_of(case, model(**inputs)), target).backward()
    model.finish_grad_sync()
    model.zero_grad()
    counts = {}
    with CommDebugMode() as comms:
        loss = loss_of(case, output_of(case, model(**inputs)), target)
    counts["forward"] = comms.get_comm_counts()
    with CommDebugMode() as comms:
        loss.backward()
    counts["backward"] = comms.get_comm_counts()
    with CommDebugMode() as comms:
        model.finish_grad_sync()
    counts["finish_grad_sync"] = comms.get_comm_counts()
    counts["model"] = model
    return counts


def _named(counts) -> dict[str, int]:
    return {str(op).rsplit(".", 1)[-1]: n for op, n in counts.items() if n}


@pytest.mark.parity
@pytest.mark.parametrize("family", LAYOUTS)
@distributed(world_size=2, timeout=300)
def test_lora_shards_its_base_and_a_step_makes_the_base_models_collectives(family):
    torch.set_default_dtype(STRICT_DTYPE)
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        base = build_hf(family).eval()
        lora = _lora(copy.deepcopy(base)).eval()
        expected = _step_comms(base, "peft/x", sequence_parallel)
        actual = _step_comms(lora, "peft/x", sequence_parallel)
        mode = "TP+SP" if sequence_parallel else "TP"
        for phase in ("forward", "backward"):  # (fewer in the backward: no grad for the frozen embedding)
            ours, theirs = _named(actual[phase]), _named(expected[phase])
            assert all(n <= theirs.get(op, 0) for op, n in ours.items()), \
                f"{family} LoRA, {mode}, {phase}: {ours}, more than the base model's {theirs}"
        # the adapters' partial grads: one bucketed all-reduce, as the base model's norms' under SP
        assert sum(_named(actual["finish_grad_sync"]).values()) <= max(1, sum(_named(expected["finish_grad_sync"]).values()))
        params = dict(actual["model"].named_parameters())
        for module, placements in LAYOUTS[family].items():
            names = [f"base_model.model.{module}.{leaf}.weight" for leaf in ("base_layer", "lora_A.default", "lora_B.default")]
            for name, placement in zip(names, placements):
                assert isinstance(params[name], DTensor) and params[name].placements == (placement,), \
                    f"{family} {mode}: {name} is laid out {getattr(params[name], 'placements', 'plain')}, not {placement}"
        trained = {n for n, p in params.items() if p.grad is not None}
        assert trained and all(".lora_" in n for n in trained), f"grads outside the adapters: {sorted(trained)[:4]}"
        assert all(p.grad is None for n, p in params.items() if not p.requires_grad)
        # and the adapters train like one process (loss, every grad, the parameters after a step)
        check_any_parity(f"peft/{family}_lora", sequence_parallel=sequence_parallel, steps=2, tol=FLOAT32_INSIDE)
