"""The zoo's patches on their own: vocab-parallel embedding (uneven rows, padding_idx, bad layouts)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed


@pytest.mark.parity
@pytest.mark.parametrize("output", ["replicate", "shard_seq"])
@distributed(world_size=2)
def test_vocab_parallel_embedding_matches_one_process(output):
    torch.set_default_dtype(STRICT_DTYPE)  # strict parity: both sides in float64
    from ndweave.dmodule import parallelize_module

    torch.manual_seed(0)
    ref = nn.Embedding(11, 4, padding_idx=7)  # 11 rows: 6 on rank 0, 5 on rank 1; row 7 on rank 1
    torch.manual_seed(0)
    emb = parallelize_module(
        nn.Embedding(11, 4, padding_idx=7),
        init_device_mesh("cpu", (2,)),
        {"parameter": {"weight": [Shard(0)]},
         "forward": {"output": [[Replicate()] if output == "replicate" else [Shard(1)]]},
         "patch": {"": ["vocab_parallel_embedding"]}},
        use_local_output=False,  # the test drives the output's own placements
    )
    assert emb.vocab_range == ((0, 6) if dist.get_rank() == 0 else (6, 11))
    ids = torch.tensor([[0, 5, 6, 7, 10, 7], [3, 3, 9, 1, 7, 6]])
    out, expected = emb(ids), ref(ids)
    assert_close(out, expected, name="lookup")
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (out * DTensor.from_local(grad, emb.device_mesh, [Replicate()]).redistribute(
        emb.device_mesh, out.placements)).sum().backward()
    (expected * grad).sum().backward()
    emb.finish_grad_sync()
    assert emb.weight.grad.placements == (Shard(0),)
    assert_close(emb.weight.grad, ref.weight.grad, name="weight grad")  # padding row 7 gets none


@distributed(world_size=2)
def test_vocab_parallel_embedding_needs_row_sharding():
    from ndweave.dmodule import parallelize_module

    with pytest.raises(ValueError, match=r"weight must be sharded \[Shard\(0\)\]"):
        parallelize_module(nn.Embedding(8, 4), init_device_mesh("cpu", (2,)),
                           {"patch": {"": ["vocab_parallel_embedding"]}})


@pytest.mark.parity
@distributed(world_size=2)
def test_deprecated_hf_gpt2_patch_names_warn_and_compute_as_the_generic_ones():
    """A plan saved before the zoo used the generic patches still loads and computes the same."""
    pytest.importorskip("transformers")
    import copy
    import io

    from dmodule_zoo_models import batch, build, run

    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan, load_plan, save_plan

    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    model = build("hf_gpt2")
    saved = get_plan("hf_gpt2", model)
    saved["patch"] = {"transformer.wte": ["vocab_parallel_embedding"],
                      r"transformer.h.\d+.attn.c_attn": ["hf_gpt2_fused_qkv"],
                      "class:GPT2Attention": ["hf_gpt2_attention_local_heads"]}
    text = io.StringIO()
    save_plan(saved, text)
    mesh = init_device_mesh("cpu", (2,))
    with pytest.warns(DeprecationWarning) as warned:
        old = parallelize_module(copy.deepcopy(model), mesh, load_plan(io.StringIO(text.getvalue())))
    said = " ".join(str(w.message) for w in warned)
    assert "'hf_gpt2_fused_qkv' is deprecated" in said and '"fused_colwise"' in said, said
    assert "'hf_gpt2_attention_local_heads' is deprecated" in said and '"divide_attributes"' in said, said
    new = parallelize_module(copy.deepcopy(model), mesh, get_plan("hf_gpt2", model))
    inputs, targets = batch("hf_gpt2", model, 0)
    assert_close(run("hf_gpt2", old, inputs, targets)[1], run("hf_gpt2", new, inputs, targets)[1], name="loss")


@distributed(world_size=2)
def test_deprecated_hf_llama_patch_name_warns_and_still_checks_the_heads():
    pytest.importorskip("transformers")
    from dmodule_zoo_models import build

    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    model = build("hf_llama", num_key_value_heads=1)
    plan = get_plan("hf_llama", model)
    plan["patch"]["class:LlamaAttention"] = ["hf_llama_attention_heads"]
    with pytest.warns(DeprecationWarning, match="'hf_llama_attention_heads' is deprecated.*tp_divides"):
        with pytest.raises(ValueError, match="num_key_value_heads=1 must both be divisible by the tensor-parallel size 2"):
            parallelize_module(model, init_device_mesh("cpu", (2,)), plan)


class _RMSNorm(nn.Module):
    """Llama's RMSNorm: statistics over the features of each position."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parity
@pytest.mark.parametrize("layout", ["shard_seq", "shard_seq_uneven", "replicate"])
@distributed(world_size=2)
def test_pointwise_local_norm_matches_one_process_with_no_dtensor_op_inside(layout):
    """A norm on the sequence shards runs on plain tensors: the same output, input grad and (partial,
    then reduced) weight grad as one process, and no DTensor op between its input and output."""
    torch.set_default_dtype(STRICT_DTYPE)
    from ndweave.dmodule import dtensor_linears, parallelize_module
    from test_dmodule_linear import _CountDTensorOps

    torch.manual_seed(0)
    ref = _RMSNorm(8)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    norm = parallelize_module(_RMSNorm(8), mesh, {"patch": {"": ["pointwise_local"]}}, use_local_output=False)
    seq = 5 if layout.endswith("uneven") else 6  # (5 positions: 3 on rank 0, 2 on rank 1)
    x = torch.randn(2, seq, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    placements = [Shard(1)] if layout.startswith("shard_seq") else [Replicate()]
    xd = DTensor.from_local(x.detach(), mesh, [Replicate()]).redistribute(mesh, placements).requires_grad_()
    with _CountDTensorOps() as local:
        out = norm(xd)
    assert not local.counts, local.counts
    with dtensor_linears(), _CountDTensorOps() as through:  # the debugging mode: DTensor's own ops
        again = norm(xd)
    assert through.counts
    assert_close(again, out, name="output through DTensor")
    assert out.placements == tuple(placements)
    expected = ref(x)
    assert_close(out, expected, name="output")
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    (out * DTensor.from_local(grad, mesh, [Replicate()]).redistribute(mesh, placements)).sum().backward()
    (expected * grad).sum().backward()
    assert_close(xd.grad, x.grad, name="input grad")
    assert_close(norm.weight.grad.full_tensor(), ref.weight.grad, name="weight grad")


@distributed(world_size=2)
def test_pointwise_local_refuses_a_sharded_parameter():
    from ndweave.dmodule import parallelize_module

    with pytest.raises(ValueError, match=r"pointwise_local on '': weight is laid out \(Shard\(dim=0\),\)"):
        parallelize_module(_RMSNorm(8), init_device_mesh("cpu", (2,)),
                           {"parameter": {"weight": [Shard(0)]}, "patch": {"": ["pointwise_local"]}})
