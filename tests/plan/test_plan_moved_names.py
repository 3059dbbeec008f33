"""The names that left ndweave-mesh for ndweave-plan in mesh 0.10 still import, for one release, as the
same objects, each with a DeprecationWarning naming its new home."""

import importlib
import sys

import pytest

import ndweave.plan.calibrate
import ndweave.plan.estimate
import ndweave.plan.layouts
import ndweave.plan.work
from ndweave.mesh import fake_world


@pytest.mark.parametrize("old, new, names", [
    ("ndweave.mesh.calibrate", ndweave.plan.calibrate, ["Machine", "calibrate", "collective_seconds"]),
    ("ndweave.mesh.planner", ndweave.plan.layouts, ["Layout", "ModelShape", "plan_layout", "enumerate_layouts"]),
    ("ndweave.mesh.contracts.estimate", ndweave.plan.estimate, ["MemoryTerm", "RankMemory", "StepTime", "TimeTerm"]),
])
def test_an_old_module_warns_and_gives_the_new_objects(old, new, names):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new.__name__} \(ndweave-plan\)"):
        module = importlib.import_module(old)
    assert all(getattr(module, name) is getattr(new, name) for name in names)
    if old == "ndweave.mesh.calibrate":  # the work counter was in calibrate too
        assert module.WorkCounter is ndweave.plan.work.WorkCounter and module.Work is ndweave.plan.work.Work


def test_old_attribute_names_warn_and_give_the_new_objects():
    import ndweave.mesh.contracts as contracts
    import ndweave.mesh.testing as testing

    with pytest.warns(DeprecationWarning, match="ndweave.mesh.contracts.StepTime moved to ndweave.plan.estimate.StepTime"):
        assert contracts.StepTime is ndweave.plan.estimate.StepTime
    with pytest.warns(DeprecationWarning, match="ndweave.mesh.testing.fake_world moved to ndweave.mesh.fake.fake_world"):
        assert testing.fake_world is fake_world
    with pytest.raises(AttributeError):
        contracts.NoSuchName
