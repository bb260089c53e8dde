"""The package's imports form no circle, those inside functions included (issue 22 found `ep/overlap.py` <->
`ep/token_link.py` <-> `ep/copy_engine.py`, and `families` -> `models` -> `kimi_k3/sizes.py` -> `plan` ->
`families`). The family registry's own `importlib.import_module("modelopt_ext.models")` is not an import
statement and is not counted: a registry imports its plugins by name, by design."""

from __future__ import annotations

import ast
from pathlib import Path

import modelopt_ext

ROOT = Path(modelopt_ext.__file__).resolve().parent


def _module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ("modelopt_ext", *path.relative_to(ROOT).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name: str, path: Path, names: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # at module level and inside functions
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in names else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {n for n in found if n in names and n != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, cycles, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on:
                low[v] = min(low[v], index[child])
    return cycles


def test_no_import_circles():
    names = _module_names()
    graph = {name: _imports(name, path, names) for name, path in names.items()}
    assert graph["modelopt_ext.ep.links"] >= {"modelopt_ext.ep.link", "modelopt_ext.ep.token_link",
                                              "modelopt_ext.ep.copy_engine"}  # the parser sees imports
    assert "modelopt_ext.ep.links" in graph["modelopt_ext.ep.overlap"]  # `from . import links` too
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
