"""The package's layout: five subpackages, imports that run one way, no circle.

Read from the source's own import statements (every ``import``/``from`` of a
``jvitals`` module, at module level or inside a function), so an import that runs
against the flow fails here before anyone draws the house. The flow (docs/LAYOUT.md):
metrics <- optim; metrics, optim, monitor <- guard <- report; the monitor imports
nothing of jvitals outside itself and no JAX.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jvitals"
PACKAGES = ("metrics", "optim", "monitor", "guard", "report")
# What each subpackage may import from jvitals (itself included).
ALLOWED = {
    "metrics": {"metrics"},
    "optim": {"metrics", "optim"},
    "monitor": {"monitor"},
    "guard": {"metrics", "optim", "monitor", "guard"},
    "report": {"monitor", "guard", "report"},
}


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The jvitals modules ``path`` imports (``from jvitals.metrics import stats``
    counts as ``jvitals.metrics.stats``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "jvitals"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jvitals":
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs if len(subs) == len(node.names) else subs | {node.module}
    return {m for m in out if m in known}


@functools.cache   # read-only: parsed once per session
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, known) - {m} for m, p in mods.items()}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def test_five_subpackages_and_nothing_else_but_the_entry_points():
    top = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__")
    assert top == sorted(["__init__.py", "reference_model.py", *PACKAGES]), top
    for pkg in PACKAGES:
        assert (ROOT / pkg / "__init__.py").is_file(), pkg
        assert not [p.name for p in (ROOT / pkg).glob("_*.py") if p.name != "__init__.py"], \
            f"{pkg}: no leading underscores inside a package (privacy is __all__)"


def test_imports_run_with_the_flow():
    against = []
    for mod, deps in graph().items():
        pkg = package_of(mod)
        if pkg is None:  # jvitals/__init__.py re-exports everything; reference_model uses the probes
            continue
        for d in deps:
            dpkg = package_of(d)
            if dpkg is None or dpkg not in ALLOWED[pkg]:
                against.append(f"{mod} imports {d}")
    assert not against, "imports against the flow (docs/LAYOUT.md):\n" + "\n".join(sorted(against))


def test_no_import_circle():
    g = graph()
    # A subpackage's __init__ re-exports its modules: the package node is not a
    # dependency of its own modules, so only module -> module edges are followed.
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if d == "jvitals":
                continue
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


_TRACKERS = tuple(f"jvitals.monitor.trackers_{m}" for m in ("bands", "baselines", "history", "spikes"))
_RULES = tuple(f"jvitals.monitor.rules_{m}" for m in ("bands", "health", "ratio", "replicas", "scale", "validation",
                                                      "window"))


@pytest.mark.parametrize("mod, banned", [
    ("jvitals.monitor.policy", ("jvitals.monitor.monitor", "jvitals.monitor.rules", *_TRACKERS, *_RULES)),
    ("jvitals.monitor.localize", ("jvitals.monitor.monitor", "jvitals.monitor.rules", *_RULES)),
    ("jvitals.monitor.types", ("jvitals.monitor.monitor", "jvitals.monitor.rules", *_RULES)),
    ("jvitals.monitor.rules", ("jvitals.monitor.monitor",)),
    *[(m, ("jvitals.monitor.monitor", "jvitals.monitor.rules", "jvitals.monitor.rules_base", *_RULES))
      for m in ("jvitals.monitor.robust", *_TRACKERS)],
    ("jvitals.monitor.rules_base", ("jvitals.monitor.monitor", "jvitals.monitor.rules", *_TRACKERS, *_RULES)),
    *[(m, ("jvitals.monitor.monitor", "jvitals.monitor.rules")) for m in _RULES],
])
def test_monitor_helpers_import_nothing_above_them(mod, banned):
    """Trackers, policy, types and localization import nothing from the monitor or the rules; a rule module
    imports nothing from the monitor or the default list."""
    g = graph()
    seen, todo = set(), [mod]
    while todo:  # everything mod pulls in, transitively, apart from package re-exports
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += [d for d in g[m] if d != "jvitals.monitor"]
    assert not seen & set(banned), (mod, sorted(seen & set(banned)))


def test_monitor_modules_say_what_they_hold():
    """Every rule class lives in a ``rules_<topic>`` module, every tracker in a ``trackers_<topic>``
    one, and no monitor module lists in its ``__all__`` a name it imports (one door per name: the
    package's ``__init__`` is the only gathering)."""
    pkg = ROOT / "monitor"
    for path in sorted(pkg.glob("*.py")):
        tree = ast.parse(path.read_text())
        defined, exported = set(), []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
                if isinstance(node, ast.ClassDef) and node.name.endswith("Rule"):
                    assert path.stem.startswith("rules_"), f"{node.name} in monitor/{path.name}"
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                defined.update(names)
                if "__all__" in names:
                    exported = [e.value for e in node.value.elts]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
        if path.name != "__init__.py":
            assert set(exported) <= defined, (path.name, sorted(set(exported) - defined))
    for name in ("BucketSeries", "DriftBand", "GapSeries", "BaselineStart", "DriftBaseline", "SpikeTracker",
                 "LayerHistory"):
        hits = [p.stem for p in pkg.glob("trackers_*.py") if f"class {name}" in p.read_text()]
        assert len(hits) == 1, (name, hits)


def test_the_monitor_package_runs_without_jax_and_the_guard_without_the_report():
    """A fresh interpreter, the top-level package stubbed so its re-exports don't
    load: the monitor needs NumPy only; the guard loads neither the report nor clu."""
    code = (
        "import sys, types\n"
        f"sys.modules['jvitals'] = types.ModuleType('jvitals'); sys.modules['jvitals'].__path__ = [{str(ROOT)!r}]\n"
        "import jvitals.monitor\n"
        "assert 'jax' not in sys.modules, 'jvitals.monitor imported jax'\n"
        "import jvitals.guard\n"
        "bad = [m for m in ('jvitals.report', 'clu', 'tensorflow', 'matplotlib') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
