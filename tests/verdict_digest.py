"""Every verdict the default monitor gives on the calibration corpus, as one record per stream.

The replay of ``tests/test_monitor_replay.py``: each stream of the corpus (every split, the
fault suite's streams too) replayed through a fresh ``jvitals.Monitor()`` at the README's
cadence (a check every 50 steps, the heavy family every 500) and at the fault suite's (every
10, as recorded), the host seeing each check's window as the README loop does
(``benchmarks/windows.py``). Every verdict is written out whole (its level, its scores, every
open, new and closed alert with every field, localizations included) and split in two:

- its **skeleton**, compared exactly: every level, step, rule, key, metric, id, onset and
  localization, and the messages' text, with each floating-point number replaced by ``#``
  (a message's numbers too);
- its **numbers**, compared within a tolerance: per stream, the count of numbers, of NaNs and
  of infinities (exact) and two position-weighted sums of ``sign(x) log1p(|x|)`` (the
  verdicts' own floats, within 1e-9 of their magnitude; the messages' printed numbers, 4
  significant digits, within 1e-4), so a last bit that another CPU's NumPy kernels round
  differently passes, and a changed figure does not.

    python tests/verdict_digest.py write     # tests/data/verdict_digests.json from this checkout
    python tests/verdict_digest.py dump SPLIT/NAME 50/500 OUT   # one stream's verdicts, a line per check
    python tests/verdict_digest.py check 50/500   # against the record: exit 1 naming the changed streams
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.util
import json
import math
import pathlib
import re
import sys
from typing import Any, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "verdict_digests.json"
CADENCES = ((50, 500), (10, 0))
SPLITS = ("tuning", "heldout", "blind")


def _load(name: str, path: pathlib.Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def scorer():
    """``benchmarks/corpus.py`` (with ``windows`` and ``fault_suite`` beside it)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return _load("jvitals_bench_corpus", ROOT / "benchmarks" / "corpus.py")


def canonical(x: Any) -> Any:
    """A JSON-able form of a verdict's parts, exact (floats by ``repr``)."""
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: canonical(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): canonical(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [canonical(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return x
    try:
        f = float(x)
    except (TypeError, ValueError):
        return repr(x)
    return "nan" if math.isnan(f) else repr(f)


_PRINTED = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


class Numbers:
    """The numbers of one stream's verdicts: exact counts and tolerant weighted sums."""

    def __init__(self) -> None:
        self.n = self.nan = self.inf = 0
        self.sums = [0.0, 0.0]         # position-weighted sum of t(x), its magnitude

    def add(self, x: float) -> None:
        if math.isnan(x):
            self.nan += 1
            return
        if math.isinf(x):
            self.inf += 1 if x > 0 else 1000
            return
        t = math.copysign(math.log1p(abs(x)), x)
        self.n += 1
        w = 1.0 + (self.n % 97) / 97.0
        self.sums[0] += w * t
        self.sums[1] += w * abs(t)

    def record(self) -> dict[str, Any]:
        return {"n": self.n, "nan": self.nan, "inf": self.inf, "sum": self.sums[0], "abs": self.sums[1]}


def skeleton(x: Any, floats: Numbers, printed: Numbers) -> Any:
    """``x`` (a verdict's canonical form) with every float replaced by ``#`` (added to
    ``floats``) and every number in a string replaced by ``#`` (added to ``printed``);
    integers (steps, ids) stay."""
    if isinstance(x, dict):
        return {k: skeleton(v, floats, printed) for k, v in x.items()}
    if isinstance(x, list):
        return [skeleton(v, floats, printed) for v in x]
    if isinstance(x, str):
        if x in ("nan", "inf", "-inf") or _is_float_repr(x):
            floats.add(float(x))
            return "#"

        def mask(m: re.Match) -> str:
            printed.add(float(m.group(0)))
            return "#"
        return _PRINTED.sub(mask, x)
    return x


def _is_float_repr(s: str) -> bool:
    try:
        return repr(float(s)) == s
    except ValueError:
        return False


def verdicts(stream, cadence: int, heavy: int) -> Iterator[tuple[int, Any]]:
    """``(step, canonical form of its verdict)`` at every check of ``stream``."""
    from jvitals.monitor.monitor import Monitor

    win = sys.modules["windows"]
    mon = Monitor()
    for step, figures in win.replay(win.thin(stream, heavy), cadence):
        yield step, canonical(mon.update(step, figures))


def record(stream, cadence: int, heavy: int) -> dict[str, Any]:
    """One stream's record: the sha256 of its verdicts' skeletons, and their numbers."""
    h = hashlib.sha256()
    floats, printed = Numbers(), Numbers()
    for step, v in verdicts(stream, cadence, heavy):
        h.update(f"{step}:{json.dumps(skeleton(v, floats, printed), sort_keys=True, separators=(',', ':'))}\n"
                 .encode())
    return {"skeleton": h.hexdigest(), "floats": floats.record(), "printed": printed.record()}


TOLERANCE = {"floats": 1e-9, "printed": 1e-4}
"""Relative tolerance of each weighted sum, against its magnitude (``abs``)."""


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What differs between two records of a stream (empty: the same verdicts)."""
    out = []
    if got["skeleton"] != want["skeleton"]:
        out.append("skeleton (a level, step, rule, metric or message text)")
    for part, tol in TOLERANCE.items():
        g, w = got[part], want[part]
        for k in ("n", "nan", "inf"):
            if g[k] != w[k]:
                out.append(f"{part}: {k} {g[k]} != {w[k]}")
        scale = max(w["abs"], 1.0)
        for k in ("sum", "abs"):
            if abs(g[k] - w[k]) > tol * scale:
                out.append(f"{part}: {k} {g[k]!r} != {w[k]!r} (tolerance {tol * scale:.3g})")
    return out


def records(splits=SPLITS, cadences=CADENCES) -> dict[str, dict[str, Any]]:
    """``{"{cadence}/{heavy}": {stream name: record}}``."""
    cp = scorer()
    out: dict[str, dict[str, Any]] = {}
    for cadence, heavy in cadences:
        key = f"{cadence}/{heavy}"
        out[key] = {}
        for split in splits:
            for st in cp.load_split(split, with_fault_suite=True):
                out[key][f"{split}/{st.name}"] = record(st, cadence, heavy)
    return out


def changed(cadence: int, heavy: int) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The record at this cadence, and ``{stream: its differences}`` for every stream whose
    verdicts differ from it now (a stream gone or new differs whole)."""
    key = f"{cadence}/{heavy}"
    want = json.loads(GOLDEN.read_text())[key]
    got = records(cadences=((cadence, heavy),))[key]
    differ = {k: ["stream gone" if k not in got else "stream new"] for k in set(want) ^ set(got)}
    differ.update({k: d for k in sorted(set(want) & set(got)) if (d := differences(got[k], want[k]))})
    return want, differ


def main(argv: list[str]) -> int:
    if argv[:1] == ["write"]:
        GOLDEN.write_text(json.dumps(records(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")
        return 0
    if argv[:1] == ["dump"] and len(argv) == 4:   # dump SPLIT/NAME CADENCE/HEAVY OUT
        cp = scorer()
        split, name = argv[1].split("/", 1)
        cadence, heavy = (int(x) for x in argv[2].split("/"))
        st = next(s for s in cp.load_split(split, with_fault_suite=True) if s.name == name)
        with open(argv[3], "w") as f:
            for step, v in verdicts(st, cadence, heavy):
                f.write(f"{step}:{json.dumps(v, sort_keys=True, separators=(',', ':'))}\n")
        return 0
    if argv[:1] == ["check"] and len(argv) == 2:   # check CADENCE/HEAVY: exit 1 naming changed streams
        want, differ = changed(*(int(x) for x in argv[1].split("/")))
        print(json.dumps({"streams": len(want), "changed": sorted(differ)}))
        return 1 if differ else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
