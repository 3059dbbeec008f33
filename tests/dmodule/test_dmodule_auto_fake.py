"""A forward that fails on meta tensors: ``torch.autocast(x.device.type, enabled=False)`` raises
"unsupported scalarType" for "meta" (OLMo-core's norms, x-transformers' rotary embedding). "auto"
traces such a model on fake tensors instead (real dtypes, shapes and device, no data), without
``example_inputs``, and the plan trains like one process."""

import pytest
import torch
from dmodule_auto_models import FLOAT32_INSIDE, AutocastLM, build_hf, check_auto_parity
from torch.distributed.tensor import Shard

from ndweave.dmodule.infer import derive
from ndweave.dmodule.infer.trace import meta_copy, trace
from ndweave.mesh.testing import distributed
from ndweave.mesh.torch_compat import FakeTensor, StridedShard


def test_autocast_model_gets_a_whole_plan_without_example_inputs():
    model = AutocastLM()
    with pytest.raises(RuntimeError):  # what the meta trace alone met
        trace(meta_copy(model), torch.zeros(2, 8, dtype=torch.long, device="meta"))
    d = derive(model)
    plan = d.plan()
    assert plan["parameter"][r"blk.\d+.b.a.weight"] == [StridedShard(0, split_factor=3)]
    assert plan["parameter"][r"blk.\d+.d.d.weight"] == [Shard(1)]
    # the head count its attention reshapes with, found by re-running it on fake tensors
    assert {"name": "divide_attributes", "args": {"names": ["n"]}} in plan["patch"][r"blk.\d+.b"]
    assert not d.replicated
    assert not any(isinstance(p, FakeTensor) for p in model.parameters())  # the model is untouched


def test_example_inputs_are_traced_on_fake_tensors_too():
    d = derive(AutocastLM(), example_inputs=((torch.zeros(3, 5, dtype=torch.long),), {}))
    assert d.trace.values[d.trace.inputs[0]].shape == (3, 5)
    assert not d.replicated


def test_a_forward_failing_on_meta_and_fake_says_both():
    class Fails(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)

        def forward(self, ids):
            raise RuntimeError("no")

    with pytest.raises(ValueError, match="on meta: RuntimeError: no; on fake: RuntimeError: no"):
        derive(Fails())


@pytest.mark.parity
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@distributed(world_size=2, timeout=180)
def test_autocast_model_matches_one_process(sequence_parallel):
    check_auto_parity("autocast", sequence_parallel=sequence_parallel)


def test_x_transformers_gets_a_plan_without_example_inputs():
    pytest.importorskip("x_transformers")  # (a test dependency, not the package's)
    plan = derive(build_hf("x_transformers")).plan()
    assert plan["parameter"]["token_emb.emb.weight"] == [Shard(0)]
    assert plan["parameter"][r"attn_layers.layers.\d+.\d+.ff.\d+.proj.weight"] == [StridedShard(0, split_factor=2)]


OLMO_CORE = ["olmo_core_llama_like", "olmo_core_olmo2_1M"]  # its two config families, tiny


@pytest.mark.parametrize("arch", OLMO_CORE)
def test_olmo_core_gets_a_plan_without_example_inputs(arch):
    pytest.importorskip("olmo_core")  # (a test dependency, not the package's)
    plan = derive(build_hf(arch)).plan()
    assert plan["parameter"]["embeddings.weight"] == [Shard(0)]
    assert plan["parameter"][r"blocks.\d+.feed_forward.w2.weight"] == [Shard(1)]


@pytest.mark.parity
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("arch", OLMO_CORE)
def test_olmo_core_matches_one_process(arch, sequence_parallel):
    pytest.importorskip("olmo_core")
    _olmo_core_parity(arch, sequence_parallel)


@distributed(world_size=2, timeout=180)
def _olmo_core_parity(arch, sequence_parallel):
    # (one step, held to FLOAT32_INSIDE: OLMo-core's norms compute in float32 whatever the model's dtype,
    # as the transformers models of test_dmodule_auto_archs.py that do)
    check_auto_parity(arch, sequence_parallel=sequence_parallel, steps=1, tol=FLOAT32_INSIDE)
