"""User mistakes and rank divergence in parallelize_module and a DModule's forward: one clear error,
raised on every rank in seconds (a rank left waiting in a collective would stop only at the harness
timeout, which these tests keep short)."""

import io
import re

import pytest
import torch
from core_models import MLP, NormMLP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from ndweave.dmodule import PlanKeyError, RankMismatchError, load_plan, parallelize_module
from ndweave.mesh.testing import distributed

R = Replicate()
PARAMS = {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)]}
MLP_TP = {"parameter": PARAMS, "forward": {"fc1.input": [[R]], "fc2.output": [[R]]}}
FAULT_TIMEOUT = 60  # seconds: a hang fails the test here instead of passing


def _mesh():
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("TP",))


def _rank():
    return torch.distributed.get_rank()


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_plain_input_without_input_plan_names_module_argument_and_fix():
    model = parallelize_module(MLP(), _mesh(), {"parameter": PARAMS})
    with pytest.raises(RuntimeError, match=re.escape("module 'fc1' (Linear) got a plain torch.Tensor for argument "
                                                     "'input' while its parameters are DTensors")) as info:
        model(torch.randn(3, 4))
    assert '{"fc1.input": [[Replicate()]]}' in str(info.value)
    assert "mixed torch.Tensor and DTensor" in str(info.value.__cause__)  # torch's error kept as the cause


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_input_of_the_wrong_width_names_the_module_and_both_shapes():
    model = parallelize_module(MLP(), _mesh(), MLP_TP)
    with pytest.raises(RuntimeError, match=re.escape(
            "module 'fc1' (Linear) takes inputs whose last dim is 4 (in_features=4), but got 'input' of shape "
            "(3, 5) [Replicate()]; pass inputs of width 4, or build the module for width 5")) as info:
        model(torch.randn(3, 5))
    assert "Sharding propagation failed" in str(info.value.__cause__)  # torch's error kept as the cause
    # a plain input under a Shard plan is this rank's piece: the message gives the global shape
    model = parallelize_module(MLP(), _mesh(), {"parameter": PARAMS, "forward": {"fc1.input": [[Shard(0)]]}})
    with pytest.raises(RuntimeError, match=re.escape("but got 'input' of shape (6, 5) [Shard(dim=0)]; pass inputs of")):
        model(torch.randn(3, 5))
    model = parallelize_module(torch.nn.Sequential(torch.nn.LayerNorm((2, 4))), _mesh(), {"forward": {"0.input": [[R]]}})
    with pytest.raises(RuntimeError, match=re.escape("module '0' (LayerNorm) takes inputs whose last 2 dims are (2, 4) "
                                                     "(normalized_shape=(2, 4)), but got 'input' of shape (3, 4, 4)")):
        model(torch.randn(3, 4, 4))
    # a module that keeps no width attribute: its inputs and parameters, global shapes and placements
    plan = {"parameter": {"c_fc.weight": [Shard(1)], "c_proj.weight": [Shard(0)]},
            "forward": {"norm.input": [[Shard(1)]], "c_fc.input": [[R]], "c_proj.output": [[Shard(1)]]}}
    model = parallelize_module(NormMLP(dim=8), _mesh(), plan)
    with pytest.raises(RuntimeError, match=re.escape(
            "module 'norm' (RMSNorm): DTensor cannot run its forward on these shapes and placements: inputs 'x' "
            "(2, 4, 6) [Shard(dim=1)]; parameters weight (8,) [Replicate()]; check its inputs' shapes")):
        model(torch.randn(2, 2, 6))


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_placement_written_as_a_string_names_the_entry_and_the_fix():
    for plan, message in [
        ({"parameter": {"fc1.weight": "Shard(0)"}}, "parameter plan 'fc1.weight': 'Shard(0)' is a string, not a "
                                                    "placement; write [Shard(0)] (from torch.distributed.tensor import"),
        ({"forward": {"fc1.input": ["Replicate"]}}, "forward plan 'fc1.input': ['Replicate'] holds strings, not "
                                                    "placements; write [[Replicate()]]"),
        ({"forward": {"fc1.input": {"input": ["Shard(0)"]}}}, "forward plan 'fc1.input'['input']: ['Shard(0)'] holds "
                                                              "strings, not placements; write [Shard(0)]"),
    ]:
        # every rank raises it, naming the rank it was found on
        with pytest.raises(TypeError, match=re.escape(f"parallelize_module failed on rank 0 (and ranks [1]): {message}")):
            parallelize_module(MLP(), _mesh(), plan)


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_plan_that_differs_by_rank_raises_on_every_rank():
    plan = {"parameter": {**PARAMS, "fc2.bias": [Shard(0) if _rank() == 1 else R]}}
    with pytest.raises(RankMismatchError, match=r"rank 1 was given another plan than rank 0: "
                                                r"\"parameter\['fc2.bias'\]\" is"):
        parallelize_module(MLP(), _mesh(), plan)


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_plan_error_on_one_rank_raises_it_on_every_rank():
    plan = {"parameter": {**PARAMS, ("fc3.bias" if _rank() == 1 else "fc2.bias"): [R]}}
    with pytest.raises(PlanKeyError, match=r"parallelize_module failed on rank 1: parameter plan key 'fc3.bias' "
                                           r"matches nothing in the module; nearest: \['fc2.bias'"):
        parallelize_module(MLP(), _mesh(), plan)


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_model_that_differs_by_rank_raises_on_every_rank():
    model = MLP(hidden=8 if _rank() == 0 else 6)
    with pytest.raises(RankMismatchError, match=r"rank 1 was given another model than rank 0: 'fc1.weight' is"):
        parallelize_module(model, _mesh(), MLP_TP)


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_presharded_shapes_inconsistent_across_ranks_name_parameter_and_shapes():
    # is_model_sharded: fc1 is Shard(0) (hidden 6 -> 3 per rank), but rank 1 holds 4 rows of fc1.weight
    local = MLP(hidden=3)
    if _rank() == 1:
        local.fc1.weight = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(RankMismatchError, match=re.escape(
            "'fc1.weight' with placements [Shard(dim=0)] has local shape (3, 4) on rank 0, expected (4, 4)")):
        parallelize_module(local, _mesh(), MLP_TP, is_model_sharded=True)
    # a non-sharded dim that differs: rank 1's fc2 reads 3 inputs... of another width
    local = MLP(hidden=3)
    if _rank() == 1:
        local.fc1.weight = torch.nn.Parameter(torch.randn(3, 5))
    with pytest.raises(RankMismatchError, match=re.escape("has local shape (3, 5) on rank 1, expected (3, 4)")):
        parallelize_module(local, _mesh(), MLP_TP, is_model_sharded=True)


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_presharded_uneven_shards_follow_torch_chunking():
    # hidden 5 over 2 ranks: torch's chunking gives 3 + 2; the reverse (2 + 3) is refused
    torch.manual_seed(0)
    full = MLP(hidden=5)
    rows = (3, 2)[_rank()]
    start = (0, 3)[_rank()]
    local = MLP(hidden=rows)
    with torch.no_grad():
        local.fc1.weight.copy_(full.fc1.weight[start:start + rows])
        local.fc1.bias.copy_(full.fc1.bias[start:start + rows])
        local.fc2.weight.copy_(full.fc2.weight[:, start:start + rows])
        local.fc2.bias.copy_(full.fc2.bias)
    dm = parallelize_module(local, _mesh(), MLP_TP, is_model_sharded=True)
    assert tuple(dm.fc1.weight.shape) == (5, 4)
    torch.testing.assert_close(dm.fc1.weight.full_tensor(), full.fc1.weight.detach(), rtol=0, atol=0)
    with pytest.raises(RankMismatchError, match=r"'fc1.weight' .* has local shape \(2, 4\) on rank 0, expected \(3, 4\)"):
        parallelize_module(MLP(hidden=(2, 3)[_rank()]), _mesh(), MLP_TP, is_model_sharded=True)


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_rank_dependent_input_shape_raises_on_every_rank():
    model = parallelize_module(MLP(), _mesh(), MLP_TP)
    with pytest.raises(RankMismatchError, match=r"forward of 'fc1': rank 1 was given another input shape than "
                                                r"rank 0: 'fc1.input\[0\]' is \(\(5, 4\), 'torch.float32'\) on rank 0 "
                                                r"but \(\(3, 4\), 'torch.float32'\) on rank 1; .*the same batch size"):
        model(torch.randn(5 if _rank() == 0 else 3, 4))


@distributed(world_size=2, timeout=FAULT_TIMEOUT)
def test_sequence_sharded_input_of_another_length_on_one_rank_raises_on_every_rank():
    plan = {"parameter": PARAMS, "forward": {"fc1.input": [[Shard(1)]], "fc1.output": [[Shard(-1)]],
                                             "fc2.output": [[R]]}}
    model = parallelize_module(MLP(), _mesh(), plan)
    with pytest.raises(RankMismatchError, match=r"'fc1.input\[0\]' is \(\(2, 3, 4\)"):
        model(torch.randn(2, 3 if _rank() == 0 else 2, 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(sharding_plan="plan.json"), "sharding_plan must be a dict (or None), got str; a JSON plan file is read with"),
    (dict(param_sharding_plan=[("fc1.weight", [R])]), "param_sharding_plan must be a dict (or None), got list"),
    (dict(is_model_sharded="yes"), "is_model_sharded must be True or False, got 'yes'"),
    (dict(use_local_output=None), "use_local_output must be True or False, got None"),
])
def test_argument_types_named_with_the_fix(kwargs, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        parallelize_module(MLP(), None, **kwargs)


def test_module_must_be_a_module_instance():
    with pytest.raises(TypeError, match=re.escape("module is the class MLP; pass an instance (MLP(...)) or deferred_init(MLP, ...)")):
        parallelize_module(MLP, None, MLP_TP)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got dict"):
        parallelize_module({}, None, MLP_TP)


@pytest.mark.parametrize("text, message", [
    ('{"parameter": {"fc1.weight": [Shard(0)]}}', "plan file plan.json, line 1 column 31: not valid JSON"),
    ('{\n  "parameter": {\n    "fc1.weight": [{"Shard": 0}],\n    "fc2.weight": ["Replicat"]\n  }\n}',
     "plan file plan.json, line 4: parameter['fc2.weight'][0]: \"Replicat\" is not a placement; valid forms: "
     "\"Replicate\", {\"Shard\": dim}"),
    ('{\n  "forward": {\n    "fc1.input": [[{"Shard": "x"}]]\n  }\n}',
     "line 3: forward['fc1.input'][0][0]: {\"Shard\": \"x\"} is not a valid placement (\"x\" is not an integer)"),
    ('{\n  "patch": {\n    "fc1": [3]\n  }\n}', "line 3: patch['fc1']: [3] is not a patch name, a {\"name\": ..., \"args\": {...}} entry"),
    ('{"paramter": {}}', "plan file plan.json: a sharding plan has the sections"),
])
def test_malformed_plan_file_names_file_line_and_valid_forms(text, message):
    f = io.StringIO(text)
    f.name = "plan.json"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_plan(f)
