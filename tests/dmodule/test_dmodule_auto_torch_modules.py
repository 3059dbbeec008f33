"""torch's own modules: ``nn.TransformerEncoder`` (``nn.MultiheadAttention``'s fused ``in_proj_weight``
projected inside ``F.multi_head_attention_forward``, no ``nn.Linear`` in sight) gets Megatron's layout
from "auto" and trains like one process."""

import pytest
from dmodule_auto_models import TorchEncoderLM, check_auto_parity
from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule.infer import derive
from ndweave.mesh.testing import distributed
from ndweave.mesh.torch_compat import StridedShard


def test_multihead_attention_gets_megatrons_layout():
    d = derive(TorchEncoderLM())
    plan = d.plan()
    attn = r"encoder.layers.\d+.self_attn"
    assert plan["parameter"][f"{attn}.in_proj_weight"] == [StridedShard(0, split_factor=3)]
    assert plan["parameter"][f"{attn}.out_proj.weight"] == [Shard(1)]
    assert plan["parameter"][r"encoder.layers.\d+.linear1.weight"] == [Shard(0)]
    assert plan["forward"][f"{attn}.output"] == [[Replicate()], None]
    assert "multihead_attention_local" in plan["patch"][attn]
    assert not d.replicated


def test_attention_asked_for_its_weights_stays_replicated():
    import torch
    from torch import nn

    class Weights(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x)[0]  # need_weights=True by default

    d = derive(Weights(), example_inputs=((torch.zeros(2, 8, 16),), {}))
    assert any("need_weights=True" in line for line in d.replicated)
    assert d.plan()["patch"] == {"": ["replicate_plain"], "attn": ["replicated_local"]}  # (every auto plan: the root)


@pytest.mark.parity
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_norm", "post_norm"])
@distributed(world_size=2, timeout=180)
def test_transformer_encoder_matches_one_process(norm_first, sequence_parallel):
    check_auto_parity("torch_encoder", sequence_parallel=sequence_parallel, norm_first=norm_first)
