"""The package's imports point one way, share only public names, and form no circle.

Layers, lowest first (docs/code.md): units and errors -> model -> schedules -> hardware -> plan ->
verify -> inputs -> published, calibrate -> exports -> render -> cli. A module may import its own
layer and the layers below it, never one above; every import is counted, also those inside
functions (an import deferred for start-up time is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckplan"
RANKS = {
    "__init__": 0,  # the version
    "errors": 0,
    "quoting": 0,
    "units": 0,
    "cache": 0,
    "lazy_names": 0,
    "model": 1,
    "schedules": 2,
    "hardware": 3,
    "plan": 4,
    # the NumPy MLP and the simple formula set: a package across layers, ranked by module
    "simple.formulas": 1,
    "simple.mlp": 1,
    "simple": 1,
    "simple.verify": 5,
    "inputs": 6,
    "published": 7,
    "calibrate": 7,
    "exports": 8,
    "render": 9,
    "cli": 10,
    "__main__": 10,
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every ckplan import of `module`."""
    path = MODULES[module]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, node, path.name == "__init__.py")
            if target.split(".")[0] != "ckplan":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:  # `from ckplan.model import memory`
                    found.append((submodule, "", node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [
                (alias.name, "", node.lineno)
                for alias in node.names
                if alias.name.split(".")[0] == "ckplan"
            ]
    return found


def _layer(module: str) -> str:
    """The key of RANKS a module falls under: its sub-package, or a module of a package that
    spans layers (ckplan.simple)."""
    parts = module.split(".")
    if len(parts) > 2 and ".".join(parts[1:3]) in RANKS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_layer():
    assert {_layer(module) for module in MODULES} <= set(RANKS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import(module):
    upward = [
        f"{module}:{line} imports {target} ({_layer(target)} is above {_layer(module)})"
        for target, _, line in _imports(module)
        if RANKS[_layer(target)] > RANKS[_layer(module)]
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_from_another_module(module):
    private = [
        f"{module}:{line} imports {name} from {target}"
        for target, name, line in _imports(module)
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not private, "\n".join(private)


def test_no_import_circle():
    graph = {
        module: {target for target, _, _ in _imports(module) if target in MODULES} - {module}
        for module in MODULES
    }
    # A package's __init__ re-exporting its modules is how a package declares its surface; a
    # module importing the package for one of those names is not a circle of the code.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    circles = _cycles(graph)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize(
    "package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and "." in m)
)
def test_every_package_declares_its_surface(package):
    tree = ast.parse(MODULES[package].read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{package} has no docstring saying what it holds"
    names = [
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    ]
    assert "__all__" in names, f"{package} declares no __all__"


def test_the_test_sees_a_lazy_upward_import(tmp_path, monkeypatch):
    """The checker itself: an import inside a function counts."""
    path = PACKAGE / "model" / "spec.py"
    source = (
        path.read_text(encoding="utf-8") + "\n\ndef _x():\n    from ckplan.plan import evaluate\n"
    )
    fake = tmp_path / "spec.py"
    fake.write_text(source, encoding="utf-8")
    monkeypatch.setitem(MODULES, "ckplan.model.spec", fake)
    assert any(target == "ckplan.plan.evaluate" for target, _, _ in _imports("ckplan.model.spec"))


def test_every_package_ships_in_the_wheel():
    """A package missing from pyproject's list installs nowhere but this checkout."""
    tomllib = pytest.importorskip("tomllib")
    root = PACKAGE.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(root).parts) for init in PACKAGE.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
