"""``@distributed(world_size=N)``: write a pytest test whose body runs on N ranks."""

from __future__ import annotations

import functools
from typing import Any, Callable

from ndweave.mesh.testing.pool import run_distributed

__all__ = ["distributed"]


def distributed(
    world_size: int,
    *,
    timeout: float | None = None,
    num_nodes: int = 1,
    device_type: str = "cpu",
    init_process_group: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Turn a test body into a pytest test that runs it on ``world_size`` ranks.

    The body runs on every rank with the default process group initialized; parametrize and fixture
    arguments are passed through (they must pickle). A failing or hanging rank fails the test with
    that rank's traceback or stack::

        @pytest.mark.parametrize("bucket_size", [10, 1000])
        @distributed(world_size=4, timeout=60)
        def test_my_ddp(bucket_size):
            mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("DP",))
            ...
    """

    def wrap(body: Callable[..., Any]) -> Callable[..., None]:
        @functools.wraps(body)
        def test(*args: Any, **kwargs: Any) -> None:
            run_distributed(
                test,
                world_size,
                *args,
                timeout=timeout,
                num_nodes=num_nodes,
                device_type=device_type,
                init_process_group=init_process_group,
                **kwargs,
            )

        test.__ndweave_body__ = body  # what the ranks run
        return test

    return wrap
