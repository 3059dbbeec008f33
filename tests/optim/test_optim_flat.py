"""One flat master per param group and bucket range: the inner optimizer steps whole runs (fused where
torch has the kernel), while ``state_dict()`` still gives per-FQN pieces, each with its own scalars."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndweave.mesh.testing import distributed
from ndweave.optim import DistributedOptimizer

from optim_common import assert_params_match, dp_setup, train, train_reference


def _owned_param_elements(bucket) -> int:
    """This rank's elements of the bucket's params (dp_setup packs them without padding)."""
    lo, hi = bucket.shard_range()
    first, last = bucket.params[0].offset, bucket.params[-1].offset + bucket.params[-1].numel
    return max(0, min(hi, last) - max(lo, first))


@distributed(world_size=2, timeout=60)
def test_one_fused_flat_master_per_bucket_range_and_per_fqn_state():
    rank = dist.get_rank()
    reference, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-2})
    (group,) = opt.param_groups
    assert [p.numel() for p in group["params"]] == [n for b in ddp.grad_buckets() if (n := _owned_param_elements(b))]
    assert group["fused"] is True
    train(ddp, opt, 3, rank, 2)
    train_reference(reference, torch.optim.Adam(reference.parameters(), lr=1e-2), 3)
    assert_params_match(ddp.module, reference)

    state = opt.state_dict()
    assert state["param_groups"][0]["fused"] is None  # saved as the user left it
    steps = [entry["step"] for entry in state["state"].values()]
    assert all(float(s) == 3 for s in steps) and len({id(s) for s in steps}) == len(steps)  # a copy each
    user_choice = DistributedOptimizer(torch.optim.Adam, [ddp], optimizer_kwargs={"lr": 1e-2, "foreach": True})
    assert not user_choice.param_groups[0]["fused"]


@distributed(world_size=2, timeout=60)
def test_a_partial_load_into_a_fresh_optimizer_keeps_the_optimizers_initial_values():
    """Rprop starts each element's step size at lr: pieces the state leaves out keep that, not zeros."""
    rank = dist.get_rank()
    _, ddp = dp_setup()
    opt = DistributedOptimizer(torch.optim.Rprop, [ddp], optimizer_kwargs={"lr": 0.05})
    train(ddp, opt, 2, rank, 2)
    everyone = [None] * 2
    dist.all_gather_object(everyone, opt.state_dict())
    for state in everyone:
        state["state"].pop("2.bias", None)
    fresh = DistributedOptimizer(torch.optim.Rprop, [dp_setup(seed=1)[1]], optimizer_kwargs={"lr": 0.05})
    fresh.load_state_dict(everyone, strict=False)
    loaded, trained = fresh.state_dict()["state"], opt.state_dict()["state"]
    for fqn, entry in loaded.items():
        if "step_size" not in entry:  # a flat master holding only left-out pieces: no state yet
            continue
        expected = torch.full_like(entry["step_size"].data, 0.05) if fqn == "2.bias" else trained[fqn]["step_size"].data
        assert torch.equal(entry["step_size"].data, expected), fqn
    checked = [None] * 2
    dist.all_gather_object(checked, "step_size" in loaded.get("2.bias", {}))
    assert any(checked)  # some rank holds 2.bias in a flat master with loaded state
