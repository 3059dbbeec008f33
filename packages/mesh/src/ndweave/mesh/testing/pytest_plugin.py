"""pytest plugin: enable with ``pytest -p ndweave.mesh.testing.pytest_plugin`` or in a conftest's
``pytest_plugins``. It closes the rank pools at the end of the session and adds
``--ndweave-timeout`` (seconds per distributed call) and the ``parity`` marker."""

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
    # ``-m parity`` selects the proof-by-parity tests, which CI re-runs under other CPU kernel sets
    config.addinivalue_line("markers", "parity: compares a parallel run with a single-process one")
    timeout = config.getoption("--ndweave-timeout")
    if timeout is not None:
        pool.DEFAULT_TIMEOUT_S = timeout


def pytest_sessionfinish(session, exitstatus) -> None:
    pool.shutdown_pools()
