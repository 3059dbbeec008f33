"""The patch registry, in one process: a plan names a patch (with JSON arguments) instead of holding
a callable, so it stays data; names and arguments are checked before any module is touched."""

import io
import re

import pytest
import torch
from core_models import MLP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from ndweave.dmodule import PlanKeyError, load_plan, parallelize_module, register_patch, save_plan
from ndweave.dmodule.patches import registered_patches
from ndweave.mesh import fake_world


@register_patch("test_scale_output")
def scale_output(module, device_mesh, fqn, *, factor=1.0):
    forward = module.forward
    module.forward = lambda x: forward(x) * factor
    module.scaled_by = (fqn, factor)


def _parallelize(plan):
    with fake_world(2):
        return parallelize_module(MLP(), init_device_mesh("cpu", (2,)), plan, use_local_output=False)


def test_a_plan_names_a_registered_patch_with_json_arguments():
    entry = {"name": "test_scale_output", "args": {"factor": 3.0}}
    model = _parallelize({"parameter": {"fc1.weight": [Shard(0)]}, "patch": {"fc2": [entry], "fc1": "test_scale_output"}})
    assert model.fc2.scaled_by == ("fc2", 3.0) and model.fc1.scaled_by == ("fc1", 1.0)
    assert registered_patches()["test_scale_output"] is scale_output


def test_patch_entries_with_arguments_survive_a_plan_file():
    plan = {"patch": {"fc2": [{"name": "test_scale_output", "args": {"factor": 3.0}}, "test_scale_output"]}}
    f = io.StringIO()
    save_plan(plan, f)
    assert load_plan(io.StringIO(f.getvalue())) == plan


@pytest.mark.parametrize("entry, error, message", [
    ("test_scale_outptu", PlanKeyError, "patch['fc2']: unknown patch 'test_scale_outptu'; registered patches: ["),
    ({"name": "test_scale_output", "args": {"factr": 2}}, TypeError,
     "patch['fc2']: patch 'test_scale_output' does not take the arguments {'factr': 2}"),
    ({"name": "test_scale_output", "arguments": {}}, TypeError, "is not a patch entry; write {\"name\": <registered name>"),
])
def test_unknown_names_and_arguments_are_refused_at_parallelize_module(entry, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _parallelize({"patch": {"fc2": [entry]}})


def test_a_taken_name_is_refused():
    register_patch("test_scale_output", scale_output)  # the same function again: a no-op
    with pytest.raises(ValueError, match=re.escape("the name 'test_scale_output' is taken by")):
        register_patch("test_scale_output", lambda module, device_mesh, fqn: None)
    with pytest.raises(TypeError, match="is not callable"):
        register_patch("test_not_callable", 3)
    assert "test_not_callable" not in registered_patches()


def test_patch_entries_that_are_not_json_cannot_be_saved():
    with pytest.raises(TypeError, match=re.escape("patch['fc2']: [{'name': 'test_scale_output', 'args': {'f': tensor(")):
        save_plan({"patch": {"fc2": [{"name": "test_scale_output", "args": {"f": torch.ones(1)}}]}}, io.StringIO())
