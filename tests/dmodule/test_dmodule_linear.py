"""``nn.Linear`` on local shards (``ndweave.dmodule.linear``): each layout of its table runs locally and
gives what DTensor gives (output, every grad and its placements) and what one process gives; any other
layout, and ``dtensor_linears()``, run through DTensor; a Llama step dispatches far fewer DTensor ops."""

import collections

import pytest
import torch
from test_dmodule_relayout import _dtensor_moves
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ndweave.dmodule import dtensor_linears, get_plan, parallelize_module
from ndweave.dmodule.linear import _derive
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed
from ndweave.mesh.torch_compat import TorchDispatchMode, tree_flatten

R, P, S0, S1, S2 = Replicate(), Partial(), Shard(0), Shard(1), Shard(2)

#: layout name -> (weight, bias, input placements, output plan): the four rows of the module's table
LAYOUTS = {
    "column": (S0, S0, R, None),
    "row": (S1, R, Shard(-1), [[R]]),  # Partial out, summed as a plan sums it
    "replicated": (R, R, R, None),
    "rows_split": (R, R, S1, None),
}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x):
        return self.proj(x)


def _run(model, x):
    """Output, and the grads of the input and the linear's weight and bias after sum(out * out)."""
    out = model(x)
    loss = (out * out).sum() if not isinstance(out, DTensor) else (out * out).sum().full_tensor()
    loss.backward()
    grads = (x.grad, model.proj.weight.grad, model.proj.bias.grad)
    model.zero_grad()
    x.grad = None
    return out, grads


@pytest.mark.parity
@pytest.mark.parametrize("layout", list(LAYOUTS))
@distributed(world_size=2, timeout=120)
def test_each_layout_runs_locally_as_dtensor_does(layout):
    torch.set_default_dtype(STRICT_DTYPE)
    weight, bias, given, output = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    torch.manual_seed(0)
    reference = _Net()
    torch.manual_seed(0)
    forward = {"proj.input": [[given]], **({"proj.output": output} if output else {})}
    model = parallelize_module(_Net(), mesh, {"parameter": {"proj.weight": [weight], "proj.bias": [bias]},
                                              "forward": forward}, use_local_output=False)
    assert type(model.proj).__name__ == "Linear" and isinstance(model.proj, nn.Linear)
    assert list(model.state_dict()) == list(reference.state_dict())
    full = torch.randn(2, 4, 8)
    ref_x = full.clone().requires_grad_()
    ref_out = reference(ref_x)
    (ref_out * ref_out).sum().backward()
    x = distribute_tensor(full, mesh, [given], src_data_rank=None).to_local().requires_grad_()

    ran_locally = []
    model.proj.register_forward_hook(
        lambda m, args, out: ran_locally.append("LocalLinear" in type(out.grad_fn).__name__), prepend=True)
    local_out, local_grads = _run(model, x)
    with dtensor_linears():
        dtensor_out, dtensor_grads = _run(model, x)
    assert ran_locally == [True, False], layout  # the local path ran, then DTensor's
    assert local_out.placements == dtensor_out.placements, layout
    assert_close(local_out, dtensor_out, name=f"{layout} output")
    assert_close(local_out, ref_out, name=f"{layout} output vs one process")
    for name, mine, theirs, ref in zip(("input", "weight", "bias"), local_grads, dtensor_grads,
                                       (None, reference.proj.weight.grad, reference.proj.bias.grad)):
        if isinstance(mine, DTensor):
            assert mine.placements == theirs.placements, (layout, name, mine.placements, theirs.placements)
        assert_close(mine, theirs, name=f"{layout} {name}.grad")
        if ref is not None:
            assert_close(mine, ref, name=f"{layout} {name}.grad vs one process")


def test_other_layouts_run_through_dtensor():
    """The table, and nothing outside it: a layout it does not name gets DTensor's own ops."""
    assert _derive(R, S0, S0, 3).output == (S2,) and _derive(R, S0, S0, 3).grad_input == (P,)
    assert _derive(S2, S1, R, 3).output == (P,) and _derive(S2, S1, R, 3).bias_once
    assert _derive(Shard(-1), S1, None, 3).grad_input == (S2,)
    assert _derive(S0, R, None, 2).grad_weight == (P,)
    for x, w, b in [(P, S0, None),     # a Partial input
                    (R, S1, None),     # row parallel on a whole input
                    (S2, S1, S0),      # row parallel with a sharded bias
                    (R, S0, R),        # column parallel with a whole bias
                    (S2, R, None),     # a replicated weight on split features
                    (S2, S0, None)]:   # column parallel on split features
        assert _derive(x, w, b, 3) is None, (x, w, b)


class _CountDTensorOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parity
@distributed(world_size=2, timeout=180)
def test_llama_step_dispatches_fewer_dtensor_ops():
    """A Llama under the zoo plan with sequence parallel: the same loss and grads with local linears as
    through DTensor, with the linears' share of DTensor's ops gone (the norms' too: ``pointwise_local``;
    the residual adds and the MLP's product stay), and the plan's moves made without DTensor's
    machinery (``relayout``; inside ``dtensor_linears()`` all of them DTensor's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_default_dtype(STRICT_DTYPE)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    model = parallelize_module(model, mesh, get_plan("hf_llama", model, sequence_parallel=True))
    ids = torch.randint(0, 128, (2, 16))

    def step():
        counter = _CountDTensorOps()
        with counter, _dtensor_moves() as moves:
            logits = model(input_ids=ids).logits  # (the loss outside: HF's computes in float32)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        model.zero_grad()
        return loss.detach(), grads, sum(counter.counts.values()), moves

    step()  # the first call agrees on shapes across ranks
    loss, grads, local_ops, local_moves = step()
    with dtensor_linears():
        dtensor_loss, dtensor_grads, dtensor_ops, dtensor_moves = step()
    assert_close(loss, dtensor_loss, name="loss")
    for name, grad in grads.items():
        assert_close(grad, dtensor_grads[name], name=f"{name}.grad")
    # every gather, reduce-scatter and hand-over one of relayout's (even shards): none planned by DTensor
    assert local_moves == [] and len(dtensor_moves) >= 20, (local_moves, dtensor_moves)
    assert local_ops < 0.3 * dtensor_ops, (local_ops, dtensor_ops)  # 46 of 226 (torch 2.13): adds, silu left
    assert local_ops <= 60, local_ops
