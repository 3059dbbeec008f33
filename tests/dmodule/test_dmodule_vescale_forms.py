"""The forward plans and ``factory=`` forms veScale users write: input plans bound to the forward
signature (keyword arguments, ``*args``, ``**kwargs``, nested values), outputs planned by field name
(dict, dataclass, HF ``ModelOutput``), ``factory={ModuleClass: ...}``, and errors that name the
thing and the fix (``PlanKeyError`` is both a ``KeyError`` and a ``ValueError``)."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from dmodule_training import check_training_parity
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndweave.dmodule import PlanKeyError, parallelize_module
from ndweave.mesh.testing import STRICT_DTYPE, assert_close, distributed

try:
    from transformers.utils import ModelOutput
except ImportError:  # transformers is an optional test extra
    ModelOutput = None

R = Replicate()


def _tp_mesh():
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("TP",))


def _kind(t):
    return tuple(t.placements) if isinstance(t, DTensor) else "plain"


def _twins(make, plan, **kwargs):
    """A one-process reference and its DModule, built from the same seed, in float64."""
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    return ref, parallelize_module(make(), _tp_mesh(), plan, **kwargs)


def _check_grads(dm, out, ref, ref_out, y):
    """One backward of a loss computed outside the model on each side; every gradient compared."""
    F.mse_loss(out, y).backward()
    dm.finish_grad_sync()
    F.mse_loss(ref_out, y).backward()
    for name, p in dm.named_parameters():
        assert_close(p.grad, ref.get_parameter(name).grad, name=f"{name}.grad")


def _rows(t):
    """This rank's rows of a batch (what a Shard(0) input plan takes a plain tensor to be)."""
    return t.tensor_split(torch.distributed.get_world_size())[torch.distributed.get_rank()]


# ------------------------------------------------------------------------------------ inputs
class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, gate=None):
        self.seen = (_kind(x), _kind(gate))
        return self.fc(x) * torch.sigmoid(gate)


@pytest.mark.parity
@distributed(world_size=2)
def test_list_input_plan_binds_keyword_arguments():
    plan = {"forward": {".input": [[Shard(0)], [Shard(0)]], ".output": [[R]]}}  # the batch split over ranks
    ref, dm = _twins(Gate, plan)
    x, gate = torch.randn(6, 4), torch.randn(6, 4)
    for call in (lambda: dm(_rows(x), _rows(gate)), lambda: dm(_rows(x), gate=_rows(gate)),
                 lambda: dm(x=_rows(x), gate=_rows(gate))):
        out = call()
        assert dm.seen == ((Shard(0),), (Shard(0),)), dm.seen  # by position or by keyword alike
        assert_close(out, ref(x, gate), name="output")
    _check_grads(dm, out, ref, ref(x, gate), torch.randn(6, 4))


class Variadic(nn.Module):
    def forward(self, a, *args, scale=None, **kwargs):
        self.seen = {"a": _kind(a), "args": [_kind(t) for t in args], "scale": _kind(scale),
                     **{k: _kind(v) for k, v in kwargs.items()}}
        return a


class Nested(nn.Module):
    def forward(self, batch, pair):
        self.seen = {"ids": _kind(batch["ids"]), "mask": _kind(batch["mask"]), "pair": [_kind(t) for t in pair],
                     "pair type": type(pair)}
        return batch["ids"]


@distributed(world_size=2)
def test_variadic_and_nested_input_plans():
    mesh, S = _tp_mesh(), Shard(0)
    a, b, c, s, t, u, v = (torch.randn(4, 2) for _ in range(7))
    by_name = parallelize_module(Variadic(), mesh, {"forward": {".input": {
        "a": [R], "args": [[S], None], "scale": [R], "kwargs": {"bias": [S]}, "extra": [R]}}})
    by_name(a, b, c, scale=s, bias=t, extra=u, other=v)
    assert by_name.seen == {"a": (R,), "args": [(S,), "plain"], "scale": (R,), "bias": (S,), "extra": (R,),
                            "other": "plain"}, by_name.seen
    by_position = parallelize_module(Variadic(), mesh, {"forward": {".input": [[R], [S], [R]]}})
    by_position(a, b, c, scale=s)  # past the named parameters, list entries go to *args
    assert by_position.seen == {"a": (R,), "args": [(S,), (R,)], "scale": "plain"}, by_position.seen

    nested = parallelize_module(Nested(), mesh, {"forward": {".input": {"batch": {"ids": [S]}, "pair": [None, [R]]}}})
    expected = {"ids": (S,), "mask": "plain", "pair": ["plain", (R,)], "pair type": tuple}
    nested({"ids": a, "mask": b}, (c, s))
    assert nested.seen == expected, nested.seen
    nested(pair=(c, s), batch={"ids": a, "mask": b})
    assert nested.seen == expected, nested.seen


# ------------------------------------------------------------------------------------ outputs
@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "kept"


if ModelOutput is not None:
    @dataclasses.dataclass
    class HFResult(ModelOutput):
        loss: torch.Tensor = None  # left None: HF leaves it out of the keys
        logits: torch.Tensor = None
        hidden: torch.Tensor = None


class Head(nn.Module):
    def __init__(self, container):
        super().__init__()
        self.container = container
        self.fc1 = nn.Linear(4, 8)  # colwise: a Shard(-1) hidden
        self.fc2 = nn.Linear(8, 4)  # rowwise: Partial logits

    def forward(self, x):
        hidden = self.fc1(x)
        logits = self.fc2(torch.relu(hidden))
        if self.container == "dict":
            return {"logits": logits, "hidden": hidden}
        if self.container == "dataclass":
            return Result(logits=logits, hidden=hidden)
        return HFResult(logits=logits, hidden=hidden)


HEAD_TP = {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)]}


def _head_loss(net, batch):
    x, y = batch
    out = net(x)
    logits, hidden = (out["logits"], out["hidden"]) if isinstance(out, dict) else (out.logits, out.hidden)
    assert type(logits) is torch.Tensor and type(hidden) is torch.Tensor  # gathered, handed back plain
    return F.mse_loss(logits, y) + hidden.pow(2).mean()


@pytest.mark.parity
@pytest.mark.parametrize("container", [
    "dict", "dataclass",
    pytest.param("model_output", marks=pytest.mark.skipif(ModelOutput is None, reason="needs transformers")),
])
@distributed(world_size=2)
def test_outputs_planned_by_field_name(container):
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    ref = Head(container)
    torch.manual_seed(0)
    model = parallelize_module(Head(container), _tp_mesh(), {"parameter": HEAD_TP, "forward": {
        "fc1.input": [[R]], ".output": {"logits": [R], "hidden": [R]}}})
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)) for _ in range(2)]
    check_training_parity(model, ref, batches, _head_loss)
    if container == "dataclass":
        assert model(batches[0][0]).note == "kept"  # fields the plan leaves alone pass through


# ------------------------------------------------------------------------------------ factory
class Probe(nn.Module):
    def forward(self, x):
        self.kind = _kind(torch.zeros(1))
        return x


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        steps = torch.arange(x.shape[0], dtype=x.dtype)
        self.kinds = (_kind(steps), _kind(torch.zeros(1)))
        return self.fc(x) + steps[:, None]


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.probe, self.fc = Inner(), Probe(), nn.Linear(4, 4)

    def forward(self, x):
        noise = torch.randn(x.shape, dtype=x.dtype)  # the model's own random draw
        built = nn.Linear(2, 2)  # torch's code creating tensors (its parameters) is not the model's
        self.kinds = (_kind(noise), _kind(built.weight))
        return self.fc(self.probe(self.inner(x)) * torch.ones(x.shape[-1])) + noise


@pytest.mark.parity
@distributed(world_size=2)
def test_factory_per_module_class():
    factory = {Outer: True, Inner: {torch.arange: [Shard(0)]}, Probe: False}  # the innermost class wins
    ref, dm = _twins(Outer, {"forward": {".input": [[R]], ".output": [[R]]}}, factory=factory)
    x, y = torch.randn(5, 4), torch.randn(5, 4)  # 5 rows: an uneven Shard(0) arange
    torch.manual_seed(1)
    out = dm(x)
    assert dm.kinds == ((R,), "plain") and dm.inner.kinds == ((Shard(0),), "plain") and dm.probe.kind == "plain"
    torch.manual_seed(1)  # the same noise drawn
    ref_out = ref(x)
    assert_close(out, ref_out, name="output")
    _check_grads(dm, out, ref, ref_out, y)
    assert type(torch.zeros(1)) is torch.Tensor  # outside the forward nothing is converted


# ------------------------------------------------------------------------------------ errors
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, hidden, mask=None):
        return self.fc(hidden)


@distributed(world_size=2)
def test_plans_naming_what_is_not_there_fail_with_the_fix():
    mesh = _tp_mesh()
    with pytest.raises(KeyError, match=r"unknown section 'fwd'; did you mean 'forward'\?") as err:
        parallelize_module(Block(), mesh, {"fwd": {}})
    assert isinstance(err.value, ValueError) and isinstance(err.value, PlanKeyError)  # old handlers still catch it
    with pytest.raises(KeyError, match=r"\.input names 'hiden', which Block\.forward\(hidden, mask=None\) does not "
                                       r"take; did you mean 'hidden'\?; rename or remove it"):
        parallelize_module(Block(), mesh, {"forward": {".input": {"hiden": [R]}}})
    with pytest.raises(KeyError, match=r"gives 3 inputs but Block\.forward\(hidden, mask=None\) takes 2 positional"):
        parallelize_module(Block(), mesh, {"forward": {".input": [[R], [R], [R]]}})
    with pytest.raises(TypeError, match=r"\['args'\] plans the variadic argument 'args': give a list"):
        parallelize_module(Variadic(), mesh, {"forward": {".input": {"args": [R]}}})
    with pytest.raises(KeyError, match=r"fc2\.weight' matches nothing.*nearest"):  # (a ValueError before)
        parallelize_module(Block(), mesh, {"parameter": {"fc2.weight": [R]}})

    typo = parallelize_module(Head("dict"), mesh, {"parameter": HEAD_TP, "forward": {"fc1.input": [[R]], ".output": {"logit": [R]}}})
    with pytest.raises(KeyError, match=r"\.output: the plan names 'logit', which this dict does not have; did you "
                                       r"mean 'logits'\?"):
        typo(torch.randn(2, 4))

    # factory=: veScale's forms, checked where they are given
    dm = parallelize_module(Block(), mesh, {"forward": {".input": [[R]]}}, factory={Block: True})  # was "unhashable"
    assert isinstance(dm(torch.randn(2, 4)), torch.Tensor)
    with pytest.raises(KeyError, match=r"factory plan key 'class:Outer' matches nothing.*class:Block"):
        parallelize_module(Block(), mesh, factory={Outer: True})
    with pytest.raises(TypeError, match=r"factory keys are module classes, e.g. \{Block: True\}; got 'fc'"):
        parallelize_module(Block(), mesh, factory={"fc": True})
    with pytest.raises(ValueError, match=r"factory\[Block\]: <built-in method tensor.*not a factory function.*"
                                         r"'torch\.zeros'"):
        parallelize_module(Block(), mesh, factory={Block: {torch.tensor: [R]}})
    with pytest.raises(ValueError, match=r"factory\[Block\]\[torch\.zeros\]: \[Shard\(dim=0\), Replicate\(\)\] on a "
                                         r"1-D mesh; give one Shard or Replicate per mesh dim"):
        parallelize_module(Block(), mesh, factory={Block: {torch.zeros: [Shard(0), R]}})


@distributed(world_size=2)
def test_vescale_entry_point_drops_what_the_forward_cannot_take_with_a_warning():
    """veScale scripts run as typed through ``ndweave.dmodule.vescale``: an input entry for an argument
    the forward does not take, or more entries than positional arguments, warn and are dropped (as
    veScale does); the entries that bind still lay out their arguments, and the outputs equal a plain
    run. ndweave's own entry point still refuses both (above)."""
    from ndweave.dmodule import vescale

    mesh = _tp_mesh()
    torch.set_default_dtype(STRICT_DTYPE)
    torch.manual_seed(0)
    ref = Block()
    x = torch.randn(2, 4)
    for plan in ({".input": {"hidden": [R], "hiden": [R]}}, {".input": [[R], [R], [R]]}):
        dm = copy.deepcopy(ref)
        with pytest.warns(UserWarning, match=r"(names 'hiden'|gives 3 inputs).*: ignored, as veScale ignores it"):
            dm = vescale.parallelize_module(dm, mesh, {"forward": plan})
        out = dm(x)
        assert isinstance(out, DTensor) and out.placements == (R,)  # veScale's outputs stay DTensors
        assert_close(out.to_local(), ref(x), name="output")
    with pytest.raises(KeyError, match="names 'hiden'"):  # scoped to veScale's call: ndweave's stays strict
        parallelize_module(copy.deepcopy(ref), mesh, {"forward": {".input": {"hiden": [R]}}})
