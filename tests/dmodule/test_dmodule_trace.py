"""ndweave.dmodule.infer.trace: one forward recorded on meta (ops, modules, values), nothing computed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ndweave.dmodule.infer.trace import Ref, Trace, meta_copy, record, trace


class Block(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], -1, 3 * x.shape[-1] // self.heads).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.proj(y.transpose(1, 2).reshape(x.shape))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.block = Block()
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        return self.head(self.block(self.emb(ids)))


def test_meta_copy_keeps_shapes_ties_and_copies_no_weights():
    model = Tiny()
    twin = meta_copy(model)
    assert all(p.is_meta for p in twin.parameters())
    assert twin.head.weight is twin.emb.weight
    assert [(n, p.shape) for n, p in twin.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]
    assert not model.emb.weight.is_meta  # the model itself is untouched


def test_trace_records_ops_modules_and_values():
    twin = meta_copy(Tiny())
    t = trace(twin, torch.zeros(2, 5, dtype=torch.long, device="meta"))
    names = [(op.name, op.module) for op in t.ops]
    assert names[0] == ("F.embedding", "emb")
    assert ("F.linear", "block.qkv") in names and ("Tensor.chunk", "block") in names
    assert ("F.scaled_dot_product_attention", "block") in names and names[-1] == ("F.linear", "head")
    view = next(op for op in t.ops if op.name == "Tensor.view")
    assert view.args[1:] == (2, 5, -1, 12)  # literal sizes are kept as data
    linear = next(op for op in t.ops if op.module == "block.qkv")
    assert t.values[linear.inputs[1]].param == "block.qkv.weight"
    assert t.values[linear.outputs[0]].shape == (2, 5, 24) and t.values[linear.outputs[0]].producer == linear.index
    chunk = next(op for op in t.ops if op.name == "Tensor.chunk")
    assert len(chunk.outputs) == 3
    assert t.aliases()[t.params["emb.weight"]] == ["emb.weight", "head.weight"]
    # module calls: children return first; each knows its arguments and outputs
    assert [c.fqn for c in t.calls] == ["emb", "block.qkv", "block.proj", "block", "head", ""]
    block = next(c for c in t.calls if c.fqn == "block")
    assert block.args == (Ref(t.ops[0].outputs[0]),) and block.outputs
    assert all(block.first_op <= op.index < block.end_op for op in t.ops if op.module.startswith("block"))
    assert t.outputs == t.ops[-1].outputs and t.inputs == t.ops[0].inputs[:1]
    assert t.consumers()[linear.outputs[0]][0].name == "Tensor.view"
    assert not twin.block._forward_hooks and not twin.block._forward_pre_hooks  # hooks removed


def test_multi_head_attention_is_entered():
    """torch's MultiheadAttention projects inside F.multi_head_attention_forward: its inner ops are
    recorded, with the outer call as their parent."""
    mha = meta_copy(nn.MultiheadAttention(8, 2, batch_first=True))
    x = torch.zeros(2, 5, 8, device="meta")
    t = trace(mha, x, x, x, need_weights=False)
    outer = next(op for op in t.ops if op.name == "F.multi_head_attention_forward")
    inner = [op for op in t.ops if op.parent == outer.index]
    assert any(op.name == "F.linear" and t.values[op.inputs[1]].param == "in_proj_weight" for op in inner)
    assert outer.index not in {op.index for op in t.leaves()}
    assert F.has_torch_function is torch.overrides.has_torch_function  # restored


def test_data_dependent_calls_get_stand_ins_on_meta():
    class Branchy(nn.Module):
        def forward(self, x):
            if (x > 0).any():  # bool() of a meta tensor
                x = x * 2
            if 0 in x:  # (transformers' padding warning: `pad_token_id in input_ids`)
                x = x * 3
            n = int(x.sum().item())
            return x[torch.nonzero(x)[:, 0]] + n

    t = trace(Branchy(), torch.zeros(4, device="meta"))
    assert [g.split(" ")[0] for g in t.guesses] == ["Tensor.__bool__", "Tensor.__contains__", "Tensor.item",
                                                   "torch.nonzero"]
    assert t.values[t.outputs[0]].shape == (4,)


def test_record_keeps_the_ops_up_to_a_failure():
    class Broken(nn.Module):
        def forward(self, x):
            return x.view(3, -1)

    got = Trace()
    with pytest.raises(RuntimeError):
        record(got, Broken(), (torch.zeros(4, device="meta"),))
    assert got.ops[-1].name == "Tensor.view" and got.ops[-1].args[1:] == (3, -1) and got.ops[-1].outputs == ()


def test_property_transpose_is_recorded():
    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 3, device="meta"))

        def forward(self, x):
            return x @ self.w.T

    t = trace(T(), torch.zeros(2, 3, device="meta"))
    assert [op.name for op in t.ops] == ["Tensor.T", "Tensor.matmul"]


def test_the_tracer_s_old_name_in_mesh_warns_and_gives_the_same_objects():
    """The tracer moved from ndweave.mesh.trace to its one user in mesh 0.10; the old name lives one release."""
    import importlib
    import sys

    import pytest

    import ndweave.dmodule.infer.trace as moved_here

    sys.modules.pop("ndweave.mesh.trace", None)
    with pytest.warns(DeprecationWarning, match=r"ndweave.mesh.trace moved to ndweave.dmodule.infer.trace"):
        old = importlib.import_module("ndweave.mesh.trace")
    assert old.trace is moved_here.trace and old.Trace is moved_here.Trace
