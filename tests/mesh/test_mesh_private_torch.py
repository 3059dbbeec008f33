"""No package and no job uses a private torch API outside ``ndweave.mesh.torch_compat``, and every
one torch_compat uses is named in its ``PRIVATE_TORCH``.

A private torch API is a name with a leading underscore reached from torch (dunders such as
``__version__`` or ``__init__`` are public protocol), as the syntax tree of each ``.py`` under
``packages/*/src`` and ``examples/`` shows it:

* a path through a torch module, or through a name imported from one: ``import torch._dynamo``,
  ``from torch.distributed.tensor._ops import x``, ``from torch.distributed.pipelining.stage import
  _RecvInfo``, ``torch._C._foo()``, ``dist._world`` (``import torch.distributed as dist``), ``F._foo``,
  ``aten._softmax`` (``aten = torch.ops.aten``), ``Shard._custom_chunk``, ``getattr(torch, "_C")``,
  a private keyword of a torch callable (``DeviceMesh(..., _init_backend=False)``);
* a private member of a torch object whose type the source does not say (``module._parameters``,
  ``getattr(func, "_schema")``): an attribute that is a private member of one of ``TORCH_CLASSES``
  (other than on ``self``/``cls``, which are the class's own);
* in a class deriving from a torch class (directly or through ndweave's classes), a private member
  of that torch class reached through ``self``, ``cls`` or ``super()``, or overridden (``def _to_tensor``).

Each use is named by a key: the dotted path for the first kind (``torch._C._current_graph_task_id``,
``torch.distributed.device_mesh.DeviceMesh(_init_backend=)``), ``Class.member`` for the others
(``Module._parameters``; ``Tensor/UntypedStorage._cdata`` where unrelated classes share the name).
``torch_compat.PRIVATE_TORCH`` lists exactly the keys torch_compat uses, each with why.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "packages/mesh/src/ndweave/mesh/torch_compat.py"

#: The torch classes whose objects ndweave code handles without the source saying so (a module, a
#: tensor, a mesh, a group, an op): an attribute named as one of their private members is theirs.
TORCH_CLASSES = (
    "torch.Tensor", "torch.nn.Parameter", "torch.UntypedStorage", "torch.distributed.tensor.DTensor",
    "torch._subclasses.fake_tensor.FakeTensor", "torch.nn.Module", "torch.fx.GraphModule", "torch.fx.Graph",
    "torch.fx.Node", "torch.optim.Optimizer", "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed.tensor.placement_types.Placement", "torch.distributed.tensor.Shard",
    "torch.distributed.tensor.Replicate", "torch.distributed.tensor.Partial",
    "torch.distributed.tensor.placement_types._StridedShard", "torch.distributed.ProcessGroup",
    "torch.distributed.Work", "torch.distributed.Store", "torch._C._distributed_c10d.Backend.Options",
    "torch._ops.OpOverload", "torch._ops.OpOverloadPacket", "torch.autograd.graph.Node",
    "torch.distributed.pipelining.PipelineStage", "torch.distributed.pipelining.schedules.PipelineScheduleSingle",
    "torch.distributed.pipelining.schedules.PipelineScheduleMulti",
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_torch(path: str | None) -> bool:
    return path is not None and (path == "torch" or path.startswith("torch."))


def _private_path(path: str) -> bool:
    return any(_private(part) for part in path.split(".")[1:])


@functools.cache
def _resolve(path: str):
    """The object at dotted ``path`` (importing its longest module prefix), or ``None``."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


@functools.cache
def _own_private_members(cls: type) -> frozenset[str]:
    """Private names ``cls`` itself defines: attributes, annotations, and ``self._x`` in its source."""
    names = {n for n in vars(cls) if _private(n)}
    names |= {n for n in vars(cls).get("__annotations__", {}) if _private(n)}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # a C++ class: its attributes are all in vars()
        return frozenset(names)
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id == "self" and _private(n.attr)}
    return frozenset(names)


def _torch_mro(cls: type) -> list[type]:
    return [k for k in cls.__mro__ if k.__module__.startswith("torch")]


def _private_members(cls: type) -> dict[str, str]:
    """``{name: owner}`` for every private member of ``cls``'s torch classes; the owner is the most
    basic torch class defining it (``Class.member`` is the use's key)."""
    members: dict[str, str] = {}
    for k in _torch_mro(cls):  # most derived first: the last one defining a name wins
        members |= dict.fromkeys(_own_private_members(k), k.__qualname__)
    return members


@functools.cache
def torch_members() -> dict[str, str]:
    """``{name: owner}`` for the private members of ``TORCH_CLASSES``: the owner is the most basic of
    those classes having it, several joined by ``/`` where unrelated classes share the name."""
    classes = [c for c in map(_resolve, TORCH_CLASSES) if isinstance(c, type)]
    having: dict[str, list[type]] = {}
    for c in classes:
        for name in _private_members(c):
            having.setdefault(name, []).append(c)
    owners = {}
    for name, cs in having.items():
        basic = {c.__qualname__ for c in cs if not any(o is not c and issubclass(c, o) for o in cs)}
        owners[name] = "/".join(sorted(basic))
    return owners


def _module_name(path: Path) -> str:
    """The name ``path`` is imported under: its path below ``src/`` (a script elsewhere: its stem)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[len(parts) - parts[::-1].index("src"):] if "src" in parts else parts[-1:]
    return ".".join(parts).removesuffix(".__init__")


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _class_index(files: dict[str, tuple[str, bool]]) -> dict[str, list[str]]:
    """``{module.Class: [base paths]}`` for the top-level classes of every scanned module
    (``files``: ``{module: (source, is_package)}``)."""
    index = {}
    for module, (source, is_package) in files.items():
        tree = ast.parse(source)
        names = _bindings(tree, module, is_package)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                index[f"{module}.{node.name}"] = [p for p in (_path(b, names) for b in node.bases) if p]
    return index


def _bindings(tree: ast.Module, module: str, is_package: bool = False) -> dict[str, str]:
    """What each imported (or aliased) name stands for, by dotted path (one scope: names are rarely reused)."""
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = f"{module}.{node.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, is_package)
            for a in node.names:
                if source and a.name != "*":
                    names[a.asname or a.name] = f"{source}.{a.name}"
    for node in ast.walk(tree):  # aliases: ``aten = torch.ops.aten``
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            path = _path(node.value, names)
            if _is_torch(path):
                names[node.targets[0].id] = path
    return names


def _path(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted path of a name or attribute chain rooted at a bound name, else ``None``."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in names:
        return ".".join([names[node.id], *reversed(attrs)])
    return None


def _torch_bases(path: str, index: dict[str, list[str]], seen: frozenset = frozenset()) -> list[type]:
    """The torch classes (or classes deriving from them, e.g. torch_compat's) a class path derives from."""
    if path in seen:
        return []
    if path in index:
        return [c for base in index[path] for c in _torch_bases(base, index, seen | {path})]
    if _is_torch(path) or path.startswith("ndweave.mesh.torch_compat."):
        cls = _resolve(path)
        if isinstance(cls, type) and _torch_mro(cls):
            return [cls]
    return []


def private_uses(source: str, module: str = "example", index: dict[str, list[str]] | None = None,
                 is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, key)`` of each private torch API ``source`` uses (see the module docstring); ``index``:
    the classes of the other modules scanned (a class may derive from a torch class through them)."""
    tree = ast.parse(source)
    index = index if index is not None else _class_index({module: (source, is_package)})
    names = _bindings(tree, module, is_package)
    members = torch_members()
    uses: list[tuple[int, str]] = []
    inner: set[int] = set()  # attribute nodes inside a longer chain from torch: the chain is judged whole

    def member_access(node: ast.AST, receiver: ast.AST, attr: str) -> None:
        """``receiver.attr`` where ``receiver`` is no torch path."""
        if not _private(attr) or _is_self(receiver) or _is_super(receiver):
            return  # the class's own (a torch class's are judged with the class)
        if attr in members:
            uses.append((node.lineno, f"{members[attr]}.{attr}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [(node.lineno, a.name) for a in node.names if _is_torch(a.name) and _private_path(a.name)]
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(module, node, is_package)
            if _is_torch(source_module):
                uses += [(node.lineno, f"{source_module}.{a.name}") for a in node.names
                         if _private_path(f"{source_module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            path = _path(node, names)
            if _is_torch(path):
                n = node.value
                while isinstance(n, ast.Attribute):
                    inner.add(id(n))
                    n = n.value
                # a private name's public attributes are not named again: its import (or alias) says it
                if any(_private(attr) for attr in path[len(names[n.id]) + 1:].split(".")):
                    uses.append((node.lineno, path))
            elif path is None or not path.startswith("ndweave."):
                member_access(node, node.value, node.attr)
        elif isinstance(node, ast.Call):
            func = _path(node.func, names)
            if _is_torch(func):
                uses += [(node.lineno, f"{func}({k.arg}=)") for k in node.keywords if k.arg and _private(k.arg)]
            args = node.args
            if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                    and len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)):
                receiver = _path(args[0], names)
                if _is_torch(receiver):
                    if _private(args[1].value):
                        uses.append((node.lineno, f"{receiver}.{args[1].value}"))
                else:
                    member_access(node, args[0], args[1].value)
            imports = func == "importlib.import_module" or (isinstance(node.func, ast.Name)
                                                            and node.func.id == "__import__")
            if imports and args and isinstance(args[0], ast.Constant) and _is_torch(args[0].value) \
                    and _private_path(args[0].value):
                uses.append((node.lineno, args[0].value))
        elif isinstance(node, ast.ClassDef):
            torch_members_of_base: dict[str, str] = {}
            for base in node.bases:
                path = _path(base, names)
                for cls in _torch_bases(path, index) if path else []:
                    torch_members_of_base |= _private_members(cls)
            if torch_members_of_base:
                uses += _subclass_uses(node, torch_members_of_base)
    return sorted(set(uses))


def _is_super(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _subclass_uses(cls: ast.ClassDef, members: dict[str, str]) -> list[tuple[int, str]]:
    """The private members of a torch base ``cls`` overrides or reaches through self, cls or super()."""
    uses = [(n.lineno, f"{members[n.name]}.{n.name}") for n in cls.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in members]
    stack = list(cls.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ClassDef):
            continue  # a nested class is judged on its own
        if isinstance(node, ast.Attribute) and node.attr in members and (_is_super(node.value) or _is_self(node.value)):
            uses.append((node.lineno, f"{members[node.attr]}.{node.attr}"))
        stack.extend(ast.iter_child_nodes(node))
    return uses


def _scanned() -> dict[Path, str]:
    files = sorted({*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("examples/**/*.py")})
    return {path: path.read_text() for path in files}


@functools.cache
def uses_by_file() -> dict[Path, list[tuple[int, str]]]:
    files = _scanned()
    index = _class_index({_module_name(p): (s, p.name == "__init__.py") for p, s in files.items()})
    return {path: private_uses(source, _module_name(path), index, path.name == "__init__.py")
            for path, source in files.items()}


def allowlist_problems(used: set[str], allowlist: dict[str, str]) -> list[str]:
    """What makes ``allowlist`` differ from the keys torch_compat uses: each side's extras."""
    return ([f"{key}: used in torch_compat, not in PRIVATE_TORCH (add it, with why)"
             for key in sorted(used - set(allowlist))]
            + [f"{key}: in PRIVATE_TORCH, no longer used (remove it)" for key in sorted(set(allowlist) - used)]
            + [f"{key}: PRIVATE_TORCH says not why" for key, why in sorted(allowlist.items()) if not why.strip()])


def test_no_package_or_job_uses_a_private_torch_api_outside_torch_compat():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {key}" for path, uses in uses_by_file().items() if path != COMPAT
                 for line, key in uses]
    assert not offenders, "reach these through ndweave.mesh.torch_compat instead:\n" + "\n".join(offenders)


def test_torch_compat_names_exactly_the_private_torch_apis_it_uses():
    from ndweave.mesh import torch_compat

    used = {key for _, key in uses_by_file()[COMPAT]}
    problems = allowlist_problems(used, torch_compat.PRIVATE_TORCH)
    assert not problems, "torch_compat.PRIVATE_TORCH:\n" + "\n".join(problems)


SYNTHETIC = '''
import importlib

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _RecvInfo
from torch.distributed.tensor import Shard
from torch.distributed.tensor._ops import registry
from torch.utils._pytree import tree_map
aten = torch.ops.aten


def uses(module, t, op, mesh):
    dist.distributed_c10d._world.pg_names
    F._canonical_mask(t)
    torch._C._current_graph_task_id()
    aten._softmax
    Shard._custom_chunk
    DeviceMesh("cpu", [0], _init_backend=False)
    module._parameters["w"] = t
    t.untyped_storage()._cdata
    getattr(op, "_schema", None)
    getattr(torch, "_C")
    importlib.import_module("torch._inductor")
    tree_map(str, {}).items()


def public(module, t, mesh):
    torch.__version__, t.__class__, module.__init__, F.linear, dist.get_rank()
    t._my_own, module.weight, mesh.get_group()


class Stage(PipelineStage):
    def _to_tensor(self, arg):
        self._mine = super()._to_tensor(arg)
        return self._mine_too


class Module(nn.Module):
    def forward(self, x):
        return x + len(self._buffers) + self._mine
'''


def test_the_guard_sees_each_kind_of_private_use():
    found = private_uses(SYNTHETIC)
    keys = {key for _, key in found}
    assert keys == {
        "torch._dynamo", "torch.distributed.pipelining.stage._RecvInfo", "torch.distributed.tensor._ops.registry",
        "torch.utils._pytree.tree_map", "torch.distributed.distributed_c10d._world.pg_names",
        "torch.nn.functional._canonical_mask", "torch._C._current_graph_task_id", "torch.ops.aten._softmax",
        "torch.distributed.tensor.Shard._custom_chunk", "torch.distributed.device_mesh.DeviceMesh(_init_backend=)",
        "Module._parameters", "Tensor/UntypedStorage._cdata", "OpOverload._schema", "torch._C", "torch._inductor",
        "PipelineStage._to_tensor", "Module._buffers",
    }, sorted(keys)
    lines = {key: line for line, key in found}
    assert lines["Module._buffers"] == SYNTHETIC.splitlines().index(
        "        return x + len(self._buffers) + self._mine") + 1


@pytest.mark.parametrize("used, allowlist, problem", [
    ({"torch._C._x", "Module._parameters"}, {"torch._C._x": "why"}, "Module._parameters: used in torch_compat, not in"),
    ({"torch._C._x"}, {"torch._C._x": "why", "DTensor._spec": "why"},
     "DTensor._spec: in PRIVATE_TORCH, no longer used"),
    ({"torch._C._x"}, {"torch._C._x": " "}, "torch._C._x: PRIVATE_TORCH says not why"),
])
def test_the_allowlist_check_fails_both_ways(used, allowlist, problem):
    assert any(p.startswith(problem) for p in allowlist_problems(used, allowlist))
    assert not allowlist_problems(used, dict.fromkeys(used, "why"))
