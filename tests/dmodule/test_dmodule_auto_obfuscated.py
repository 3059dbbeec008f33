"""A Llama-shaped model whose module names mean nothing (``blk.0.b.a`` is a fused q|k|v, ``blk.0.d``
a SwiGLU MLP) and whose attention reshapes with a literal head count: "auto" finds Llama's layout
from the dataflow alone, and it trains like one process."""

import pytest
import torch
from dmodule_auto_models import Obfuscated, check_auto_parity
from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule import PlacementSpec
from ndweave.dmodule.infer import derive
from ndweave.mesh.testing import distributed
from ndweave.mesh.torch_compat import StridedShard

LOCAL_REPLICATE = [PlacementSpec([Replicate()], to_local=True)]


def test_auto_finds_llamas_layout_without_names():
    plan = derive(Obfuscated()).plan()
    assert plan["parameter"] == {
        "e.weight": [Shard(0)],                                # vocab-parallel embedding
        r"blk.\d+.b.a.weight": [StridedShard(0, split_factor=3)],  # q|k|v: each rank its heads of each
        r"blk.\d+.b.b.weight": [Shard(1)],                     # o_proj: row-wise
        r"blk.\d+.d.c.weight": [StridedShard(0, split_factor=2)],  # gate|up: each rank its share of both
        r"blk.\d+.d.d.weight": [Shard(1)],                     # down_proj: row-wise
        "g.weight": [Shard(0)],                                # LM head: column-wise
    }
    forward = plan["forward"]
    assert forward[r"blk.\d+.b.b.input"] == [[Shard(-1)]] and forward[r"blk.\d+.b.b.output"] == [[Replicate()]]
    assert forward[r"blk.\d+.d.d.output"] == [[Replicate()]] and forward["e.output"] == [[Replicate()]]
    assert forward["g.output"] == LOCAL_REPLICATE                       # logits gathered
    # Megatron's f: the RMSNorms hand their output over plain, the blocks take it back replicated
    assert forward[r"blk.\d+.a.output"] == forward[r"blk.\d+.c.output"] == forward["f.output"] == LOCAL_REPLICATE
    assert forward[r"blk.\d+.b.a.input"] == forward[r"blk.\d+.d.c.input"] == forward["g.input"] == [[Replicate()]]
    patches = plan["patch"]
    assert {"name": "divide_attributes", "args": {"names": ["n"]}} in patches[r"blk.\d+.b"]  # the literal head count
    assert patches[r"blk.\d+.b.a"] == [{"name": "fused_colwise", "args": {"pieces": 3}}]
    assert patches["e"] == ["vocab_parallel_embedding"]


def test_the_model_keeps_its_head_count():
    model = Obfuscated()
    derive(model)
    assert model.blk[0].b.n == 4 and not model.blk[0].b._forward_hooks


@pytest.mark.parity
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@distributed(world_size=2, timeout=180)
def test_obfuscated_model_matches_one_process(sequence_parallel):
    check_auto_parity("obfuscated", sequence_parallel=sequence_parallel)
