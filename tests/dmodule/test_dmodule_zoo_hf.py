"""Plan zoo, "hf_llama" and "hf_gpt2": the real transformers classes, unchanged, parallelized with
``get_plan(name, model)`` alone, match one process on 2 and 4 ranks (TP and TP+SP)."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dmodule_zoo_models import build, check_deferred, check_parity  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402
from ndweave.mesh.torch_compat import StridedShard as _StridedShard  # noqa: E402

from ndweave.mesh.testing import distributed  # noqa: E402

MODES = pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])


@pytest.mark.parity
@MODES
@distributed(world_size=2)
def test_hf_llama_plan_matches_one_process_on_2_ranks(sequence_parallel):
    # 8 query heads, 4 key/value heads: grouped-query attention
    check_parity("hf_llama", sequence_parallel=sequence_parallel)


@pytest.mark.parity
@distributed(world_size=4)
def test_hf_llama_plan_matches_one_process_on_4_ranks_eager_tied():
    check_parity("hf_llama", attn_implementation="eager", tie_word_embeddings=True)


@distributed(world_size=4)
def test_hf_llama_plan_refuses_kv_heads_that_do_not_split():
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    model = build("hf_llama", num_key_value_heads=2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with pytest.raises(ValueError, match="num_key_value_heads=2 must both be divisible by the tensor-parallel size 4"):
        parallelize_module(model, mesh, get_plan("hf_llama", model))


@pytest.mark.parity
@MODES
@distributed(world_size=2)
def test_hf_gpt2_plan_matches_one_process_on_2_ranks(sequence_parallel):
    # vocab 50257 splits 25129 + 25128; lm_head is tied to wte
    check_parity("hf_gpt2", sequence_parallel=sequence_parallel)


@pytest.mark.parity
@distributed(world_size=4)
def test_hf_gpt2_plan_matches_one_process_on_4_ranks_sdpa_adam():
    check_parity("hf_gpt2", attn_implementation="sdpa", optimizer="adam")


@pytest.mark.parity
@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
@distributed(world_size=2)
def test_hf_plans_with_deferred_init(name):
    check_deferred(name)


@distributed(world_size=2)
def test_hf_gpt2_plan_layout():
    """Uneven vocabulary rows, one tied weight, and the fused qkv laid out per rank as [q_r|k_r|v_r]."""
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    model = build("hf_gpt2")
    c_attn = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(model, mesh, get_plan("hf_gpt2", model))
    rank = dist.get_rank()
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte and wte.placements == (Shard(0),)
    assert wte.to_local().shape == ((25129, 32) if rank == 0 else (25128, 32))
    assert model.transformer.wte.vocab_range == ((0, 25129) if rank == 0 else (25129, 50257))
    w = model.transformer.h[0].attn.c_attn.weight
    assert w.placements == (_StridedShard(1, split_factor=3),)
    q, k, v = c_attn.split(32, dim=1)
    half = slice(16 * rank, 16 * (rank + 1))
    assert (w.to_local() == torch.cat([q[:, half], k[:, half], v[:, half]], dim=1)).all()
    assert (w.full_tensor() == c_attn).all()
    assert "transformer.h.0.attn.c_attn.weight" in model.dump_plan()


@distributed(world_size=2)
def test_hf_gpt2_deferred_init_keeps_only_local_c_attn_columns():
    """The plan's parameter section lays c_attn out strided, so deferred init never keeps it whole."""
    from ndweave.dmodule import deferred_init, parallelize_module
    from ndweave.dmodule.plans import get_plan

    torch.manual_seed(0)
    eager = build("hf_gpt2")
    torch.manual_seed(0)
    model = parallelize_module(deferred_init(build, "hf_gpt2"), init_device_mesh("cpu", (2,)), get_plan("hf_gpt2"))
    for i, block in enumerate(model.transformer.h):
        for name, full in (("weight", eager.transformer.h[i].attn.c_attn.weight),
                           ("bias", eager.transformer.h[i].attn.c_attn.bias)):
            p = getattr(block.attn.c_attn, name)
            assert p.placements == (_StridedShard(full.dim() - 1, split_factor=3),)
            assert p.to_local().shape[-1] == 3 * 32 // 2 and torch.equal(p.full_tensor(), full)
    stats = model._materialize_stats
    local = sum(t.to_local().numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert stats.local_bytes == local, stats  # a Replicate c_attn would count its full (E, 3E) here
    assert stats.peak_bytes <= local + stats.largest_full_param_bytes, stats


@distributed(world_size=2)
def test_hf_gpt2_fused_qkv_patch_needs_the_strided_layout():
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    model = build("hf_gpt2")
    plan = get_plan("hf_gpt2", model)
    del plan["parameter"][r"transformer.h.\d+.attn.c_attn.weight"]  # arrives Replicate
    with pytest.raises(ValueError, match=r"c_attn.weight: a projection fused from 3 pieces must be laid out "
                                         r"\[_StridedShard\(dim, split_factor=3\)\] in the plan's parameter section"
                                         r".*; it is \(Replicate\(\),\)"):
        parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
