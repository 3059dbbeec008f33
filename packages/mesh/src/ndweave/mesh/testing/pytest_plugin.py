"""pytest plugin: enable with ``pytest -p ndweave.mesh.testing.pytest_plugin`` or in a conftest's
``pytest_plugins``. It closes the rank pools at the end of the session and adds
``--ndweave-timeout`` (seconds per distributed call) and the ``parity`` and ``kernels`` markers."""

from __future__ import annotations

from ndweave.mesh.testing import pool


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--ndweave-timeout",
        type=float,
        default=None,
        help="seconds a distributed test may run before its ranks' stacks are dumped and it fails",
    )


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "parity: compares a parallel run with a single-process one")
    # ``-m kernels``: the parity tests whose bound is fp32 / bf16 rounding, which other CPU kernel sets
    # move; worth re-running under them (float64-strict ones are not: kernels move them by ~1e-16)
    config.addinivalue_line("markers", "kernels: held to a bound of fp32 / bf16 rounding (measured, or of a "
                                       "float32 sum): re-run it under other CPU kernel sets")
    timeout = config.getoption("--ndweave-timeout")
    if timeout is not None:
        pool.DEFAULT_TIMEOUT_S = timeout


def pytest_sessionfinish(session, exitstatus) -> None:
    pool.shutdown_pools()
