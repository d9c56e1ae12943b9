"""Python sources read straight out of wheels that must never be installed here (vLLM pins another
torch; vllm-ascend and torch-npu need CANN), for conformance tests that check names by AST.

.ci/run downloads the wheels (`pip download --no-deps`) and names them in ASPC_*_WHEEL variables;
elsewhere they are downloaded once into the same folder, and a test that cannot get one skips."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CACHE = Path(tempfile.gettempdir()) / "aspc-ci-wheels"


def wheel(variable: str, requirement: str, platform: str = "manylinux_2_28_x86_64") -> Path:
    """The wheel .ci/run downloaded ($variable), else one downloaded into CACHE; skips if neither."""
    given = os.environ.get(variable)
    if given:
        return Path(given)
    stem = requirement.split("==")[0].replace("-", "_")
    version = requirement.split("==")[1]
    found = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                 "--python-version", "3.11", "--platform", platform, "-d", str(CACHE), requirement],
                                capture_output=True, text=True)
        found = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
        if not found:
            pytest.skip(f"cannot download {requirement}: {result.stderr.strip()[-200:]}")
    return found[0]


@dataclass
class Sources:
    """Module name -> source text, for the .py files of some top-level packages; parsed on demand
    (a text search picks the few modules worth parsing)."""
    texts: dict[str, str] = field(default_factory=dict)
    parsed: dict[str, ast.Module | None] = field(default_factory=dict)

    @classmethod
    def from_wheel(cls, path: Path, packages: tuple[str, ...], under: str = "") -> Sources:
        """The .py files of `packages` in the wheel; `under`: a folder they sit in, dropped from the
        module names (torch-npu ships torchair as torch_npu/dynamo/torchair, imported as torchair)."""
        sources = cls()
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                inner = name.removeprefix(under)
                if name.startswith(under) and inner.endswith(".py") and inner.split("/")[0] in packages:
                    sources.add(inner, archive.read(name).decode("utf-8", errors="replace"))
        return sources

    @classmethod
    def installed(cls, package: str) -> Sources:
        """The .py files of an installed package (megatron-core 0.16.1, the test extra's)."""
        import importlib.util

        root = Path(next(iter(importlib.util.find_spec(package).submodule_search_locations)))  # a namespace too
        sources = cls()
        for path in sorted(root.rglob("*.py")):
            sources.add(f"{package}/{path.relative_to(root).as_posix()}", path.read_text(encoding="utf-8"))
        return sources

    def add(self, filename: str, text: str) -> None:
        self.texts[filename[:-3].replace("/", ".").removesuffix(".__init__")] = text

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.parsed:
            try:
                self.parsed[module] = ast.parse(self.texts[module]) if module in self.texts else None
            except SyntaxError:
                self.parsed[module] = None
        return self.parsed[module]

    def trees_with(self, text: str) -> list[ast.Module]:
        """The parsed modules whose source contains `text`."""
        return [t for m, source in self.texts.items() if text in source and (t := self.tree(m)) is not None]

    def classes(self, name: str) -> list[ast.ClassDef]:
        return [node for tree in self.trees_with(f"class {name}") for node in ast.walk(tree)
                if isinstance(node, ast.ClassDef) and node.name == name]

    def class_in(self, module: str, name: str) -> ast.ClassDef:
        return next(node for node in ast.walk(self.tree(module))
                    if isinstance(node, ast.ClassDef) and node.name == name)

    def members(self, name: str, seen: frozenset = frozenset()) -> set[str]:
        """Methods, class attributes, dataclass fields and self.X assignments of every class called
        `name` here, and of their bases (looked up by name)."""
        found: set[str] = set()
        for cls in self.classes(name):
            found |= _own_members(cls)
            for base in cls.bases:
                base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                if base_name and base_name not in seen | {name}:
                    found |= self.members(base_name, seen | {name})
        return found

    def functions(self, name: str) -> list[ast.FunctionDef]:
        return [node for tree in self.trees_with(f"def {name}") for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name]

    def defines(self, module: str, name: str) -> bool:
        """Whether `module` defines, imports or lazily exports `name` (vLLM's __init__ maps names to
        modules in a dict of strings)."""
        tree = self.tree(module)
        if tree is None:
            return False
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
                return True
            if isinstance(node, ast.Assign | ast.AnnAssign) and name in _targets(node):
                return True
            if isinstance(node, ast.ImportFrom | ast.Import) and any((a.asname or a.name).split(".")[-1] == name
                                                                     for a in node.names):
                return True
        return f'"{name}"' in self.texts[module] or f"'{name}'" in self.texts[module]


def _own_members(cls: ast.ClassDef) -> set[str]:
    found = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            found |= _targets(node)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _name(node.value) == "self":
            found.add(node.attr)
    return found


def _targets(node) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def parameters(function: ast.FunctionDef) -> set[str]:
    args = function.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}


def accepts_any_keyword(function: ast.FunctionDef) -> bool:
    return function.args.kwarg is not None


def dataclass_fields(sources: Sources, module: str, name: str) -> set[str]:
    """Annotated fields of a dataclass and of its bases (looked up by name in the same package)."""
    return _annotated(sources, [sources.class_in(module, name)], set())


def _annotated(sources: Sources, classes: list[ast.ClassDef], seen: set[str]) -> set[str]:
    fields = set()
    for cls in classes:
        seen.add(cls.name)
        fields |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        bases = [_name(b) for b in cls.bases if _name(b) and _name(b) not in seen]
        fields |= _annotated(sources, [c for b in bases for c in sources.classes(b)], seen)
    return fields


def string_arguments(sources: Sources, receiver: str, method: str, position: int = 0) -> set[str]:
    """String literals passed as the `position`-th argument of `receiver.method(...)` anywhere."""
    found = set()
    for tree in sources.trees_with(f"{receiver}.{method}("):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
                    and _name(node.func.value) == receiver and len(node.args) > position
                    and isinstance(node.args[position], ast.Constant) and isinstance(node.args[position].value, str)):
                found.add(node.args[position].value)
    return found


def _name(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def dict_keys(sources: Sources, module: str, variable: str) -> set[str]:
    """String keys of the dict literal assigned to `variable` in `module` (vLLM's envs tables)."""
    for node in ast.walk(sources.tree(module)):
        if isinstance(node, ast.Assign | ast.AnnAssign) and variable in _targets(node) \
                and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"{module} has no dict {variable}")
