"""Imports run one way: the package's top-level parts (a module, or a folder as one part) form no
circle, lazy imports (inside functions) and TYPE_CHECKING ones included.

A circle hidden behind a lazy import still ties the parts into one: neither can be read, tested or
moved without the other (config.py once reached methods/ for its rule hooks while every method read
config.py's Config). Parts: ``feddifrc_app/<name>.py`` or ``feddifrc_app/<folder>/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "feddifrc_app"


def part(dotted: str) -> str | None:
    """``feddifrc_app.methods.fednh.node`` -> ``methods``; None outside the package or for its root."""
    names = dotted.split(".")
    return names[1] if names[0] == PKG.name and len(names) > 1 else None


def imported(path: Path) -> set[str]:
    """Every feddifrc_app part ``path`` imports, anywhere in the file (relative imports resolved)."""
    here = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        here = here[:-1] + ["__init__"]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(p for a in node.names if (p := part(a.name)))
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: -node.level]) if node.level else ""
            module = ".".join(x for x in (base, node.module or "") if x)
            if module == PKG.name:  # from feddifrc_app import methods, log
                found.update(a.name for a in node.names)
            elif p := part(module):
                found.add(p)
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        src = part(".".join(path.relative_to(PKG.parent).with_suffix("").parts))
        if src is None or src == "__init__":
            continue
        edges.setdefault(src, set()).update(imported(path) - {src})
    return edges


def circle(edges: dict[str, set[str]]) -> list[str]:
    """One circle of ``edges`` (its parts in order, the first repeated last), or [] if none."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return []

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return []


def test_the_packages_parts_import_one_way() -> None:
    edges = graph()
    assert {"config", "config_loader", "methods", "halves", "train"} <= set(edges), sorted(edges)
    assert circle(edges) == [], " -> ".join(circle(edges))


def test_the_reader_sees_lazy_type_checking_and_package_imports() -> None:
    """The graph is read from the code: the lazy and TYPE_CHECKING imports a circle hid behind."""
    edges = graph()
    assert "methods" in edges["config_loader"]  # the loader runs every method's rules
    assert "halves" in edges["train"] and "halves" in edges["methods"]
    assert "config" in edges["halves"] and "results" in edges["halves"]  # results: TYPE_CHECKING only
    assert "config_loader" not in edges["config"] and "methods" not in edges["strategy_rules"]
    # A circle is found, and named in order, wherever it starts.
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set(), "c": {"b"}}) == []
