"""The rule table is written once, in docs/MONITOR.md: it must say what the code does."""

from __future__ import annotations

import pathlib

from jvitals.monitor.policy import Policy
from jvitals.monitor.rules import default_rules

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "MONITOR.md"


def _table() -> list[list[str]]:
    lines = DOC.read_text().split("## The rule table", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| #")]
    out = []
    for ln in rows:
        if set(ln) <= set("|- "):
            continue
        out.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return out


def _ticks(cell: str) -> list[str]:
    return [c.strip().strip("`") for c in cell.split(",") if c.strip()]


def test_the_rule_table_matches_default_rules():
    rows = _table()
    rules = default_rules(Policy())
    assert len(rows) == len(rules), [r[1] for r in rows]
    for i, (row, rule) in enumerate(zip(rows, rules), 1):
        num, name, cls, ids, levels = row[:5]
        assert int(num) == i, row
        assert name.strip("`") == rule.name, (i, name, rule.name)
        mod = type(rule).__module__.rsplit(".", 1)[1] + ".py"
        assert cls == f"`{type(rule).__name__}` ({mod})", (i, cls)
        assert _ticks(ids) == list(rule.alert_ids), (rule.name, ids)
        assert _ticks(levels) == [lv.name for lv in rule.levels], (rule.name, levels)
        assert hasattr(Policy(), row[5].strip("`")), (rule.name, row[5])


def test_the_table_is_not_written_again_in_the_code():
    root = DOC.parents[1] / "jvitals" / "monitor"
    for f in ("rules.py", "monitor.py", "__init__.py"):
        assert "Rule table" not in (root / f).read_text(), f


def test_monitor_module_docstrings_are_short():
    """A module's docstring says what it holds and why in at most 15 lines; the long
    explanations live in docs/MONITOR.md (or the doc they belong to), under a heading it names."""
    import ast

    pkg = pathlib.Path(__file__).resolve().parents[1] / "jvitals" / "monitor"
    long = {}
    for path in sorted(pkg.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        assert doc, f"{path.name} has no module docstring"
        if len(doc.strip("\n").splitlines()) > 15:
            long[path.name] = len(doc.strip("\n").splitlines())
    assert not long, long
    text = DOC.read_text()
    for heading in ("The monitor's update", "The window rules (between the checks)",
                    "Localization: the earliest sign", "The trackers"):
        assert f"## {heading}\n" in text, heading
