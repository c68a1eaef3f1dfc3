"""The package's size rules (docs/architecture.md), which benchmarks/, scripts/ and docker/ keep too:
no module over 500 lines, no function over 50, none with more than 6 positional parameters. (That
the orchestrators name no method is tests/test_methods.py's.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "feddifrc_app"
CHECKED = (PACKAGE, ROOT / "benchmarks", ROOT / "scripts", ROOT / "docker")
OUTPUTS = ROOT / "benchmarks" / "out"  # what benchmarks write (git-ignored), not code
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_POSITIONAL = 500, 50, 6


def _modules() -> list[Path]:
    return sorted(p for folder in CHECKED for p in folder.rglob("*.py") if OUTPUTS not in p.parents)


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _positional(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def test_no_module_is_over_the_line_limit():
    over = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_is_too_long_or_takes_too_many_positionals():
    long, wide = [], []
    for p in _modules():
        for fn in _functions(p):
            where = f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name}"
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES:
                long.append(where)
            if _positional(fn) > MAX_POSITIONAL:
                wide.append(where)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
    assert not wide, f"functions with more than {MAX_POSITIONAL} positional parameters: {wide}"


def test_the_layout_check_can_fail(tmp_path):
    """The checks above read real code: a long function is found."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def f(a, b, c, d, e, f, g):\n{body}\n")
    (fn,) = _functions(tmp_path / "m.py")
    assert fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES and _positional(fn) == 7


def test_no_test_file_imports_another():
    """A helper two test files share has one home outside the test files (fakes.py, data_helpers.py,
    ...): importing a test file ties one file's tests to another's internals. Imports inside
    functions count too."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] if node.module else [a.name for a in node.names]  # from . import x
            else:
                continue
            found += [f"{path.name}:{node.lineno} {n}" for n in names if ".test_" in f".{n}"]
    assert not found, f"test files imported as modules (move the helper to a helper module): {found}"
