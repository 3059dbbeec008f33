"""Plan zoo, "mlp" and "nanogpt": ``parallelize_module(model, mesh, get_plan(name, model))`` matches
one process (outputs, loss, every gradient, parameters after optimizer steps) on 2 and 4 ranks."""

import pytest
import torch.distributed as dist
from dmodule_zoo_models import build, check_deferred, check_parity
from torch.distributed.device_mesh import init_device_mesh

from ndweave.mesh.testing import distributed

MODES = pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])


@pytest.mark.parity
@MODES
@distributed(world_size=2)
def test_mlp_plan_matches_one_process(sequence_parallel):
    check_parity("mlp", sequence_parallel=sequence_parallel)


@pytest.mark.parity
@MODES
@distributed(world_size=2)
def test_nanogpt_plan_matches_one_process_on_2_ranks(sequence_parallel):
    check_parity("nanogpt", sequence_parallel=sequence_parallel)


@pytest.mark.parity
@MODES
@distributed(world_size=4)
def test_nanogpt_plan_matches_one_process_on_4_ranks(sequence_parallel):
    check_parity("nanogpt", sequence_parallel=sequence_parallel)


@pytest.mark.parity
@distributed(world_size=2)
def test_nanogpt_plan_untied_without_biases_with_adam():
    check_parity("nanogpt", sequence_parallel=True, optimizer="adam", tie_weights=False, bias=False)


@pytest.mark.parity
@distributed(world_size=2)
def test_nanogpt_plan_with_deferred_init():
    check_deferred("nanogpt")


@distributed(world_size=4)
def test_nanogpt_plan_refuses_heads_that_do_not_split():
    from ndweave.dmodule import parallelize_module
    from ndweave.dmodule.plans import get_plan

    model = build("nanogpt", n_head=2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with pytest.raises(ValueError, match="n_head=2 does not split over the 4 ranks"):
        parallelize_module(model, mesh, get_plan("nanogpt", model))
