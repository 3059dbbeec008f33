import ast
from pathlib import Path

import ndweave.dmodule

ROOT = "ndweave.dmodule"


def test_dmodule_package_follows_the_rules(check_package):
    check_package("dmodule")


def _root_imports(path: Path, package: str) -> list[str]:
    """The import statements of ``path`` (a file of ``package``) that reach the package root for a
    name: ``from ndweave.dmodule import x``, ``import ndweave.dmodule[.x] [as y]`` (bound through the
    root's attributes, which ``__init__`` rebinds: ``deferred_init`` is a module until ``__init__``
    imports the function of that name) and relative imports that resolve to the root."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if f"{a.name}.".startswith(f"{ROOT}.")]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: level 1 is this file's package, each more level one package up
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if target == ROOT:
                names = ", ".join(a.name for a in node.names)
                found.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import {names}")
    return found


def test_no_module_of_the_package_imports_its_root():
    root = Path(ndweave.dmodule.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path != root / "__init__.py":
            package = ".".join((ROOT, *path.parent.relative_to(root).parts))
            offenders += [f"{path.relative_to(root)} {s}" for s in _root_imports(path, package)]
    assert not offenders, f"import names from the submodule that defines them, not the package root: {offenders}"


def test_the_core_does_not_import_the_zoo():
    # the zoo (plans/) builds on the core; the core finds the zoo's patches by name (patches.py)
    root = Path(ndweave.dmodule.__file__).parent
    for path in root.glob("*.py"):
        if path.name != "__init__.py":
            imported = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
            assert f"{ROOT}.plans" not in imported and not any(m and m.startswith(f"{ROOT}.plans.") for m in imported), path.name


def test_the_check_finds_root_imports(tmp_path):
    # the check above can fail: each form of reaching the root is found, a submodule import is not
    source = tmp_path / "m.py"
    source.write_text("from ndweave.dmodule import PlacementSpec\nimport ndweave.dmodule.deferred_init as d\n"
                      "from . import api\nfrom .. import x\nfrom ndweave.dmodule.spec import PlacementSpec\n"
                      "from .spec import PlanKeyError\n")
    assert _root_imports(source, ROOT) == ["line 1: from ndweave.dmodule import PlacementSpec",
                                           "line 2: import ndweave.dmodule.deferred_init", "line 3: from . import api"]
    assert _root_imports(source, f"{ROOT}.plans") == ["line 1: from ndweave.dmodule import PlacementSpec",
                                                      "line 2: import ndweave.dmodule.deferred_init",
                                                      "line 4: from .. import x"]
