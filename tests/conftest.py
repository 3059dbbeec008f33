"""Checks every package's tests share: the dependency rule and the version in one place."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"mesh"}


def _check_package(name: str) -> None:
    module = importlib.import_module(f"ndweave.{name}")
    pyproject = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == f"ndweave-{name}"
    assert module.__version__ == pyproject["project"]["version"], "__version__ and pyproject disagree"
    assert isinstance(module.__all__, list) and all(hasattr(module, n) for n in module.__all__)
    deps = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0] for d in pyproject["project"]["dependencies"]}
    assert deps <= {"torch", "numpy", "ndweave-mesh"}, f"ndweave-{name} depends on {deps}"
    src = ROOT / "packages" / name / "src" / "ndweave"
    assert not (src / "__init__.py").exists(), "ndweave is a PEP 420 namespace: no ndweave/__init__.py"
    pattern = re.compile(r"^\s*(?:from|import)\s+ndweave\.(\w+)", re.M)
    for path in (src / name).rglob("*.py"):
        for sibling in pattern.findall(path.read_text()):
            assert sibling in ALLOWED | {name}, f"{path.relative_to(ROOT)} imports ndweave.{sibling}; share it via ndweave.mesh"


@pytest.fixture
def check_package():
    """``check_package("ddp")`` asserts the package's metadata, namespace layout and imports."""
    return _check_package

