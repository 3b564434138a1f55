"""Issue 27, items 3 and 7, on the calibration corpus' HELD-OUT and BLIND parts
(tests/data/corpus/heldout, .../blind): real training runs of model families, data and
optimizers the monitor was never tuned on (the blind part was not even looked at before
it was scored)
(benchmarks/corpus.py; README tests/data/corpus/README.md), replayed through the default
``Monitor()`` at the README's cadence (a check every 50 steps, the heavy family every 500)
and at the fault suite's (every 10, heavy every 50).

- Quiet when healthy: at most 1 YELLOW per 20,000 healthy steps (the healthy streams and the
  pre-fault part of the fault streams), no ORANGE/RED.
- Leads: median lead >= 1.5x over OLMo-core's loss-only rule fed the same checks; no fault
  where the first alert comes later than that rule (periodic shocks aside: one recovered
  spike is no alert by design); no alert after a fault naming an onset or a localization
  departure more than one check before it; an unmistakable departure (the update/param
  ratio per unit LR x5 in one check, read off the stream here) alerts at that check.

The replay and the baseline rule are ``benchmarks/corpus.py``'s and ``benchmarks/fault_suite.py``'s
(the corpus' own scorer); the jump checks are recomputed here from the streams with NumPy.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import pathlib
import statistics
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow   # the slow tier: the calibration corpus replayed under four policies

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "corpus"
SCORER = ROOT / "benchmarks" / "corpus.py"
CADENCES = [(50, 500), (10, 0)]          # (check every, heavy family every; 0: as recorded, 50)
SPLITS = ("heldout", "blind")            # blind: nobody tuned on it or looked at it before it was scored
NEW_FAMILY = {"heldout": "llama", "blind": "gptneo"}
EXEMPT_LATER = ("periodic_shocks",)     # one recovered spike is no alert, by design


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod     # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


sys.path.insert(0, str(ROOT / "benchmarks"))
cp = _load("jvitals_bench_corpus", SCORER)
fs = cp.fs


@functools.lru_cache(maxsize=None)
def streams(split: str):
    return tuple(cp.load_split(split, CORPUS, with_fault_suite=False))


@functools.lru_cache(maxsize=None)
def scores(split: str, cadence: int, heavy: int):
    from jvitals.monitor.monitor import Monitor

    res = cp.score_corpus(split, CORPUS, cadence, heavy, monitor_factory=Monitor,
                          streams=list(streams(split)))
    print(f"\n{cp.format_scores(res)}")
    return res


@pytest.mark.parametrize("split", SPLITS)
def test_the_part_is_there_and_held_out(split):
    sts = streams(split)
    assert all(st.meta.get("split") == split for st in sts)
    healthy = [st for st in sts if not st.meta.get("fault")]
    faults = [st for st in sts if st.meta.get("fault")]
    assert healthy and faults, (len(healthy), len(faults))
    families = {st.meta.get("model_family") for st in sts}
    assert NEW_FAMILY[split] in families, families     # a model family never used for tuning


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cadence,heavy", CADENCES)
def test_quiet_when_healthy(split, cadence, heavy):
    """At most 1 YELLOW per 20,000 healthy steps (healthy streams, and fault streams before
    their fault), no ORANGE or RED; each rule's count is printed with the Policy fields that
    tune it."""
    res = scores(split, cadence, heavy)
    h = res["healthy"]
    pre = [a for x in res["faults"].values() for a in x["false_leads"]]
    steps = h["steps"] + sum(x["fault_step"] for x in res["faults"].values())
    yellow = h["yellow"] + sum(a["level"] == "YELLOW" for a in pre)
    worse = h["orange_red"] + sum(a["level"] in ("ORANGE", "RED") for a in pre)
    print(f"healthy steps {steps} (healthy streams {h['steps']}): {yellow} YELLOW, {worse} ORANGE/RED; "
          f"per rule: { {r: c['total'] for r, c in h['rules'].items()} }; before faults: {pre}")
    assert worse == 0, (h["alerts"], pre)
    assert yellow * 20_000 <= steps, (yellow, steps, h["alerts"], pre)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cadence,heavy", CADENCES)
def test_leads_over_the_loss_rule(split, cadence, heavy):
    res = scores(split, cadence, heavy)
    faults = res["faults"]
    # The lead of each fault, recomputed: (loss rule's delay) / (jvitals' delay), each
    # floored at one cadence; inf when only jvitals fires, 0 when only the loss rule does.
    leads = []
    for x in faults.values():
        jv, olmo, f = x["first_alert"], x["olmo"], x["fault_step"]
        if jv is None:
            lead = math.nan if olmo is None else 0.0
        elif olmo is None:
            lead = math.inf
        else:
            lead = max(olmo - f, cadence) / max(jv - f, cadence)
        assert lead == x["lead"] or (math.isnan(lead) and math.isnan(x["lead"]))
        leads.append(lead)
    finite = [x for x in leads if not math.isnan(x)]
    assert finite and statistics.median(finite) >= 1.5, sorted(finite)
    later = [n for n, x in faults.items()
             if x["first_alert"] is not None and x["olmo"] is not None and x["first_alert"] > x["olmo"]
             and not str(x["fault"]).startswith(EXEMPT_LATER)]
    assert not later, {n: (faults[n]["first_alert"], faults[n]["olmo"]) for n in later}
    missed_by_us = [n for n, x in faults.items() if x["first_alert"] is None and x["olmo"] is not None]
    assert not missed_by_us, missed_by_us


# Found by the BLIND part's first scoring and left as found (a fix made after looking would
# make the part no longer blind): at a cadence of 10, the RED that escalates
# lr_x1000_once on ref-l3g re-localizes and names grad/Wq_rms/layer_2 as departing at 1150,
# 50 steps (one heavy sample) before the fault: that figure fell 45% between its 1050 and
# 1100 samples, against a rising reference line, and the fault pushed it further the same
# way, so the run of off samples reaches back past the fault. The earlier ORANGE and the
# other alerts name update/param_ratio at 1200. Strict: this fails the day it is fixed.
KNOWN_EARLY = {("blind", 10): "lr_x1000_once.ref-l3g.pysite.rmsprop.linear.s2105"}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cadence,heavy", CADENCES)
def test_no_alert_names_a_departure_before_the_fault(split, cadence, heavy):
    res = scores(split, cadence, heavy)
    early = {n: (x["fault_step"], x["onset"], x["departure"]) for n, x in res["faults"].items()
             if (x["onset"] is not None and x["onset"] < x["fault_step"] - cadence)
             or (x["departure"] is not None and x["departure"] < x["fault_step"] - cadence)}
    known = KNOWN_EARLY.get((split, cadence))
    if known is not None:
        assert set(early) == {known}, early
        pytest.xfail(f"known: {known} names a departure at {early[known][2]} (issue note)")
    assert not early, early


def _first_jump(st, cadence: int, heavy: int, ratio: float = 5.0) -> int | None:
    """The first check at or after the fault where the global update/param ratio per unit
    LR is >= ``ratio`` x its value at the previous check (from the stream, NumPy)."""
    if "update/param_ratio" not in st.series or "opt/learning_rate" not in st.series:
        return None
    st = cp.thin_heavy(st, heavy)
    f = int(st.meta["fault_step"])
    u, lr = st.dense("update/param_ratio"), st.dense("opt/learning_rate")
    checks = [s for s, _ in fs.replay(st, cadence)]
    r = {s: u[s] / lr[s] for s in checks if np.isfinite(u[s]) and np.isfinite(lr[s]) and lr[s] > 0}
    for a, b in zip(checks, checks[1:]):
        if b >= f and a in r and b in r and r[a] > 0 and r[b] >= ratio * r[a]:
            return b
    return None


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cadence,heavy", CADENCES)
def test_an_unmistakable_update_jump_alerts_at_its_check(split, cadence, heavy):
    """Where the update ratio per unit LR jumped x5 or more between two checks after the
    fault, the monitor's first alert is at that check (or earlier, after the fault)."""
    res = scores(split, cadence, heavy)
    seen = 0
    for st in streams(split):
        if not st.meta.get("fault"):
            continue
        at = _first_jump(st, cadence, heavy)
        if at is None:
            continue
        seen += 1
        x = res["faults"][st.name]
        assert x["first_alert"] is not None and x["first_alert"] <= at, (st.name, at, x["first_alert"])
    assert seen, "no held-out fault with an x5 update jump: the check would be vacuous"


# Issue 35's target: at most 1 of 21 faults missed at checks every 50 (heavy 500) and every 10,
# with the README loop's windows and free per-group figures (the scorer's default), on every
# split. HELD-OUT missed 5 and 2 at the first scoring (docs/DIAGNOSIS.md says which and why), 4
# and 2 once the loop read the largest attention logit every step, 2 and 2 once the val-rise rule
# read sparse samples, 0 and 0 once the group rule judged a growth that does not slow (set on
# TUNING runs of those faults on setups of their own, scored once).


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cadence,heavy", CADENCES)
def test_at_most_one_fault_missed(split, cadence, heavy):
    res = scores(split, cadence, heavy)
    assert len(res["missed"]) <= 1, res["missed"]
