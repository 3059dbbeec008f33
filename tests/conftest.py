"""Checks every package's tests share: the dependency rule and the version in one place."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

from mesh_releases import imported_mesh_names, released, version_key

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
    if name != "mesh":
        _check_mesh_floor(name, pyproject["project"]["dependencies"], src / name)


def _check_mesh_floor(name: str, dependencies: list[str], package_src: Path) -> None:
    """The package's ``ndweave-mesh>=X`` floor offers every mesh name it imports (an older mesh that
    satisfies the floor would break at import)."""
    floor = next(re.search(r">=\s*([\d.]+)", d)[1] for d in dependencies if d.startswith("ndweave-mesh"))
    for used, where in sorted(imported_mesh_names(package_src).items()):
        since = released(used)
        assert since is not None, (
            f"{where} imports {used}, which no released ndweave-mesh has: bump mesh's __version__ (and pyproject), "
            "run `python tests/mesh_releases.py`, and raise ndweave-" + name + "'s ndweave-mesh floor to it")
        assert version_key(since) <= version_key(floor), (
            f"{where} imports {used}, new in ndweave-mesh {since}, but ndweave-{name} requires only "
            f"ndweave-mesh>={floor}: raise the floor in packages/{name}/pyproject.toml")


@pytest.fixture
def check_package():
    """``check_package("ddp")`` asserts the package's metadata, namespace layout and imports."""
    return _check_package

