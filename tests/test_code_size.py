"""The package's rooms stay small: no module over 700 lines, no function over 80 lines
or with more than 8 parameters (``self``/``cls`` not counted; ``*args`` and ``**kwargs``
one each), no class with more than 25 methods (issue 33's limits, read from the source
with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jvitals"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PARAMS, MAX_METHODS = 700, 80, 8, 25


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    names += ["*" + a.vararg.arg] if a.vararg else []
    names += ["**" + a.kwarg.arg] if a.kwarg else []
    return names


def _violations() -> list[str]:
    out = []
    for path in _modules():
        src = path.read_text()
        rel = path.relative_to(PACKAGE.parent)
        lines = src.count("\n")
        if lines > MAX_MODULE_LINES:
            out.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION_LINES})")
                p = _params(node)
                if len(p) > MAX_PARAMS:
                    out.append(f"{rel}:{node.lineno} {node.name}: {len(p)} parameters (at most {MAX_PARAMS})")
            elif isinstance(node, ast.ClassDef):
                m = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(m) > MAX_METHODS:
                    out.append(f"{rel}:{node.lineno} class {node.name}: {len(m)} methods (at most {MAX_METHODS})")
    return out


def test_the_checker_sees_the_package():
    """The walk finds the package's modules and counts a known function's parameters."""
    mods = {p.relative_to(PACKAGE).as_posix() for p in _modules()}
    assert {"__init__.py", "monitor/monitor.py", "guard/rollback.py", "metrics/stats.py"} <= mods
    fn = ast.parse("def f(self, a, b=1, *c, d, **e): pass").body[0]
    assert _params(fn) == ["a", "b", "d", "*c", "**e"]


def test_no_module_function_or_class_over_the_limits():
    bad = _violations()
    assert not bad, "over the limits:\n" + "\n".join(bad)
