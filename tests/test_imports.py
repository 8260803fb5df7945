"""The package's modules import each other without a circle: every import statement (top level or lazy,
inside a function) of a jaxpaged module is an arrow, and no arrow path leads from a module back to itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it installs as (pyproject's [tool.setuptools.package-dir]).
PACKAGES = {
    "jaxpaged": "jaxpaged",
    "models": "jaxpaged.models",
    "server": "jaxpaged.server",
    "pallas_kernels": "jaxpaged.kernels",
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, whether it is a package's ``__init__``)."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            modules[name] = (path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, except under ``if TYPE_CHECKING:`` (never run, so they
    cannot close a circle at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from _imports(node)


def _parents(module: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the jaxpaged modules it imports. Importing ``a.b.c`` runs ``a`` and ``a.b`` first, so those
    are arrows too, except the importer's own enclosing packages (always already running) unless it takes a
    name from one: that name must already be defined."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        own_packages = set(_parents(name))
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:  # relative: level 1 is this module's package, each further level one up
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import x` imports the submodule pkg.x when there is one, else takes a name of pkg.
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            targets.update(submodules)
            if len(submodules) < len(node.names):
                targets.add(base)
        for target in targets & modules.keys() - {name}:
            graph[name].add(target)
            graph[name].update(p for p in _parents(target) if p in modules and p not in own_packages | {name})
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One arrow path through ``component`` from its first module back to it (breadth first: the shortest)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def test_the_graph_sees_lazy_relative_and_submodule_imports():
    graph = _import_graph()
    assert "jaxpaged.kernels.cpu_attention" in graph["jaxpaged.kernels.dispatch"]  # lazy, inside a function
    assert "jaxpaged.kernels.kv_ops" in graph["jaxpaged.kernels.dispatch"]  # `from package import module`
    assert "jaxpaged.kernels" in graph["jaxpaged.models.decoder"]  # a package's own names
    hidden = ast.parse("if TYPE_CHECKING:\n    import a\nelse:\n    import b\ndef f():\n    import c\n")
    assert [node.names[0].name for node in _imports(hidden)] == ["b", "c"]  # TYPE_CHECKING's branch skipped


def test_no_import_circle_between_modules():
    graph = _import_graph()
    circles = [" -> ".join(_cycle_in(c, graph)) + f"  (component: {', '.join(c)})" for c in _circles(graph)]
    assert not circles, "import circles:\n" + "\n".join(circles)
