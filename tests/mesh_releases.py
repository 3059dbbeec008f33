"""The names each released ``ndweave-mesh`` version offers, so a package's test can check that its
``ndweave-mesh>=X`` floor offers every name it imports (a floor that only works with a newer mesh
installs fine and breaks at import).

``python tests/mesh_releases.py`` rewrites ``mesh_releases.json`` from git: for every mesh
``__version__``, the top-level names of each ``ndweave.mesh`` module at the last commit on main's
first-parent line that had it (what main shipped under that version: names added after the bump
commit count). Run it after a mesh release to record it (until then the working tree stands for a
version newer than those recorded; a name added without a version bump belongs to no release).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = "packages/mesh/src"
RELEASES = Path(__file__).with_name("mesh_releases.json")

__all__ = ["imported_mesh_names", "module_names", "released", "version_key"]


def module_names(source: str) -> set[str]:
    """The names a module defines or imports at top level (what ``from module import name`` finds)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module(path: str) -> str:
    return path[len(SRC) + 1:-3].replace("/", ".").removesuffix(".__init__")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def _write() -> None:
    init = f"{SRC}/ndweave/mesh/__init__.py"
    releases: dict[str, dict[str, list[str]]] = {}
    for commit in reversed(_git("log", "--first-parent", "--format=%H", "--", SRC).split()):  # oldest first: the last one wins
        version = re.search(r'__version__ = "([^"]+)"', _git("show", f"{commit}:{init}"))
        if version is None:
            continue
        files = [p for p in _git("ls-tree", "-r", "--name-only", commit, f"{SRC}/ndweave/mesh").split() if p.endswith(".py")]
        releases[version[1]] = {_module(p): sorted(module_names(_git("show", f"{commit}:{p}"))) for p in files}
    lines = ",\n".join(f"{json.dumps(v)}: {{\n" + ",\n".join(f"  {json.dumps(m)}: {json.dumps(n)}" for m, n in sorted(mods.items()))
                        + "\n}" for v, mods in releases.items())
    RELEASES.write_text("{\n" + lines + "\n}\n")  # one module per line: a release's diff reads


def released(name: str) -> str | None:
    """The first mesh version offering ``name`` (``module`` or ``module:attr``), ``None`` if none does.

    The releases recorded in ``mesh_releases.json``, then the working tree's mesh if its version is
    newer than all of them (a bump not yet recorded): a name added without a bump belongs to none."""
    releases = json.loads(RELEASES.read_text())
    tree_version = re.search(r'__version__ = "([^"]+)"', (ROOT / SRC / "ndweave/mesh/__init__.py").read_text())[1]
    if max(map(version_key, releases)) < version_key(tree_version):
        releases[tree_version] = {_module(str(p.relative_to(ROOT))): sorted(module_names(p.read_text()))
                                  for p in (ROOT / SRC / "ndweave/mesh").rglob("*.py")}
    module, _, attr = name.partition(":")
    for version in sorted(releases, key=version_key):
        names = releases[version].get(module)
        if names is not None and (not attr or attr in names):
            return version
    return None


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def imported_mesh_names(package_src: Path) -> dict[str, str]:
    """``module:attr`` (or ``module``) of every ``ndweave.mesh`` name the package imports -> a file using it."""
    found: dict[str, str] = {}
    for path in package_src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ndweave.mesh"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    # `from ndweave.mesh import testing` names a module, not an attribute
                    key = sub if (ROOT / SRC / (sub.replace(".", "/") + ".py")).exists() or \
                        (ROOT / SRC / sub.replace(".", "/")).is_dir() else f"{node.module}:{alias.name}"
                    found.setdefault(key, str(path.resolve().relative_to(ROOT)))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("ndweave.mesh"):
                        found.setdefault(alias.name, str(path.resolve().relative_to(ROOT)))
    return found


if __name__ == "__main__":
    _write()
