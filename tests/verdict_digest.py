"""Every verdict the default monitor gives on the calibration corpus, as one digest per stream.

The replay of ``tests/test_monitor_replay.py``: each stream of the corpus (every split, the
fault suite's streams too) replayed through a fresh ``jvitals.Monitor()`` at the README's
cadence (a check every 50 steps, the heavy family every 500) and at the fault suite's (every
10, as recorded), the host seeing each check's window as the README loop does
(``benchmarks/windows.py``). Every verdict is written out whole, canonically (its level, its
scores, every open, new and closed alert with every field, localizations included; floats by
``repr``), and hashed per stream. A refactor of the host side that keeps the verdicts bit for
bit keeps every digest.

    python tests/verdict_digest.py write     # tests/data/verdict_digests.json from this checkout
    python tests/verdict_digest.py dump SPLIT/NAME 50/500 OUT   # one stream's verdicts, a line per check
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.util
import json
import math
import pathlib
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


def verdicts(stream, cadence: int, heavy: int) -> Iterator[tuple[int, str]]:
    """``(step, canonical JSON of its verdict)`` at every check of ``stream``."""
    from jvitals.monitor.monitor import Monitor

    win = sys.modules["windows"]
    mon = Monitor()
    for step, figures in win.replay(win.thin(stream, heavy), cadence):
        v = mon.update(step, figures)
        yield step, json.dumps(canonical(v), sort_keys=True, separators=(",", ":"))


def digests(splits=SPLITS, cadences=CADENCES) -> dict[str, dict[str, str]]:
    """``{"{cadence}/{heavy}": {stream name: sha256 of its verdicts}}``."""
    cp = scorer()
    out: dict[str, dict[str, str]] = {}
    for cadence, heavy in cadences:
        key = f"{cadence}/{heavy}"
        out[key] = {}
        for split in splits:
            for st in cp.load_split(split, with_fault_suite=True):
                h = hashlib.sha256()
                for step, text in verdicts(st, cadence, heavy):
                    h.update(f"{step}:{text}\n".encode())
                out[key][f"{split}/{st.name}"] = h.hexdigest()
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["write"]:
        GOLDEN.write_text(json.dumps(digests(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")
        return 0
    if argv[:1] == ["dump"] and len(argv) == 4:   # dump SPLIT/NAME CADENCE/HEAVY OUT
        cp = scorer()
        split, name = argv[1].split("/", 1)
        cadence, heavy = (int(x) for x in argv[2].split("/"))
        st = next(s for s in cp.load_split(split, with_fault_suite=True) if s.name == name)
        with open(argv[3], "w") as f:
            for step, text in verdicts(st, cadence, heavy):
                f.write(f"{step}:{text}\n")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
