"""The calibration corpus' stored streams (tests/data/corpus) are what the README says.

Each stream is loaded and its figures are checked against independent arithmetic where
that is cheap: ``opt/learning_rate`` against the schedule written here in NumPy, the
clip figures against ``min(||g||, 1)``, the update ratio against its two norms, the
token rate against the batch shape, the dynamic loss scale against its rule replayed
from the skipped steps, the group shares against 1. Then the split: the held-out part
holds a model family, a data source and an optimizer no tuning stream uses, and seeds
disjoint from the tuning part's (fault_suite's included); every fault is on at least two
setups, one of them held out. The BLIND part: model families, data, optimizers, schedules
and seeds of its own, no fault_suite stream. NumPy only, no training.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORPUS_DIR = ROOT / "tests" / "data" / "corpus"


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


corpus = _load("jvitals_bench_corpus", ROOT / "benchmarks" / "corpus.py")
fs = corpus.fs
PATHS = sorted(CORPUS_DIR.glob("*/*.npz"))
IDS = [f"{p.parent.name}/{p.stem}" for p in PATHS]


@functools.lru_cache(maxsize=None)
def stream(path: pathlib.Path):
    return fs.load_stream(path)


def schedule(meta: dict, t: np.ndarray) -> np.ndarray:
    """The learning rate at update ``t``, written from the setup's definition."""
    peak, w, h = meta["peak_lr"], meta["warmup_steps"], meta["horizon"]
    end = peak * meta["end_frac"]
    t = t.astype(np.float64)
    if meta["schedule"] == "cosine":
        after = end + (peak - end) * 0.5 * (1 + np.cos(np.pi * np.clip((t - w) / (h - w), 0, 1)))
    elif meta["schedule"] == "constant":
        after = np.full_like(t, peak)
    elif meta["schedule"] == "linear":   # BLIND
        after = peak + (end - peak) * np.clip((t - w) / (h - w), 0, 1)
    elif meta["schedule"] == "rsqrt":    # BLIND
        after = peak * np.sqrt(w / np.maximum(t, w))
    else:  # wsd
        d = round(meta["decay_frac"] * h)
        after = np.where(t < h - d, peak, peak + (end - peak) * np.clip((t - (h - d)) / d, 0, 1))
    return np.where(t < w, peak * t / max(w, 1), after)


def test_there_is_a_corpus():
    assert len(PATHS) >= 40, f"{len(PATHS)} streams under {CORPUS_DIR}: run `python benchmarks/corpus.py generate`"


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_stream_format_and_definition(path):
    st = stream(path)
    m = st.meta
    assert m["name"] == path.stem and m["split"] == path.parent.name
    run = corpus.RUN_BY_NAME[m["name"]]   # every stored stream is a defined run, as defined
    assert (run.steps, run.seed, run.fault, run.fault_step, run.setup) == \
        (st.steps, m["seed"], m["fault"], m["fault_step"], m["setup"]["name"])
    assert (dict(run.params), run.description, run.level, run.group) == \
        (m["params"], m["description"], m["level"], m["group"])
    assert m["format_version"] == fs.FORMAT_VERSION and m["group_figures"] == "recorder"
    for name in ("loss", "grad/global_norm", "opt/learning_rate", "param/global_norm", "update/param_ratio"):
        idx, _ = st.series[name]
        assert len(idx) == st.steps, name                     # the every-step family, every step
    idx, _ = st.series["val/loss"]
    np.testing.assert_array_equal(idx, np.arange(0, st.steps, m["layers_every"]))
    for name in ("grad/share/layer_0", "update/param_ratio/embedding", "act/hidden_states_rms.avg"):
        np.testing.assert_array_equal(st.series[name][0], idx, err_msg=name)


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_figures_against_independent_arithmetic(path):
    st = stream(path)
    m = st.meta
    lr = st.dense("opt/learning_rate")
    count = np.arange(st.steps)
    if "opt/skipped_steps" in st.series:   # fp16: a skipped step keeps the optimizer state, count included
        skipped = st.dense("opt/skipped_steps")
        before = np.concatenate([[0.0], skipped[:-1]])
        count = count - before
        kept = skipped > before            # the recorder's figures are those of the kept (previous) state
        np.testing.assert_array_equal(lr[1:][kept[1:]], lr[:-1][kept[1:]])
        count, lr = count[~kept], lr[~kept]
    np.testing.assert_allclose(lr, schedule(m, count), rtol=2e-5, atol=1e-9)
    g, post = st.dense("grad/global_norm"), st.dense("grad/global_norm_post_clip")
    ok = np.isfinite(g)
    np.testing.assert_allclose(post[ok], np.minimum(g[ok], m["clip"]), rtol=1e-5)
    u, p, r = st.dense("update/global_norm"), st.dense("update/param_ratio"), st.dense("param/global_norm")
    ok = np.isfinite(u) & np.isfinite(r) & (r > 0)
    np.testing.assert_allclose(p[ok], u[ok] / r[ok], rtol=1e-4)
    rate = st.dense("sys/tokens_per_sec") / st.dense("sys/steps_per_sec")
    rate = rate[np.isfinite(rate)]
    np.testing.assert_allclose(rate, m["batch"] * m["seq"], rtol=1e-6)
    share = sum(st.dense(n) for n in st.series if n.startswith("grad/share/"))
    healthy = np.arange(st.steps) < (m["fault_step"] if m["fault"] else st.steps)
    ok = np.isfinite(share)
    assert ok.any() and np.all(share[ok] <= 1 + 1e-4)
    assert np.all(share[ok & healthy] > 0.5)      # the groups hold most of a healthy gradient


@pytest.mark.parametrize("path", [p for p in PATHS if "fp16" in p.stem], ids=lambda p: p.stem)
def test_loss_scale_follows_its_rule(path):
    """log2(scale) = 15 - skips + doublings, a doubling after every 500 finite steps in a row."""
    st = stream(path)
    scale, skipped = st.dense("opt/loss_scale"), st.dense("opt/skipped_steps")
    want, good, prev_skip, s = [], 0, 0.0, 2.0 ** 15
    for k in range(st.steps):
        if skipped[k] > prev_skip:
            s, good = max(s / 2, 1.0), 0
        else:
            good += 1
            if good >= 500:
                s, good = s * 2, 0
        prev_skip = skipped[k]
        want.append(s)
    np.testing.assert_array_equal(scale, want)


@pytest.mark.parametrize("path", [p for p in PATHS if not stream(p).meta["fault"]], ids=lambda p: p.stem)
def test_healthy_streams_are_finite_and_learn(path):
    st = stream(path)
    for name, (_, v) in st.series.items():
        if "nonfinite" not in name:
            assert np.all(np.isfinite(v)), name
    assert np.all(st.dense("grad/nonfinite_count") == 0)
    loss = st.dense("loss")
    assert loss[-200:].mean() < 0.75 * loss[:20].mean()
    if "text" in st.meta:
        t = st.meta["text"]
        assert t["train_tokens"] > 100 * t["val_tokens"] / 20 and 0 < t["n_val_files"] < t["n_files"]


def _split(name: str) -> list:
    return [stream(p) for p in PATHS if p.parent.name == name]


def test_split_holds_what_the_readme_says():
    tuning, held = _split("tuning"), _split("heldout")
    fs_seeds = {r.seed for r in fs.RUNS + fs.EXTRA_RUNS}
    t_seeds = {st.meta["seed"] for st in tuning} | fs_seeds
    assert not t_seeds & {st.meta["seed"] for st in held}
    for key, only in (("model_family", "llama"), ("data", "pydocs"), ("optimizer", "sgdm")):
        assert not any(st.meta[key] == only for st in tuning), key
        assert any(st.meta[key] == only for st in held), key
    healthy = {sp: sum(st.steps for st in _split(sp) if not st.meta["fault"]) for sp in corpus.SPLITS}
    fs_healthy = sum(r.steps for r in fs.RUNS if not r.fault)
    assert healthy["tuning"] + fs_healthy + healthy["heldout"] >= 100_000, healthy
    assert healthy["heldout"] >= 40_000, healthy


def test_every_fault_on_two_setups_one_held_out():
    faults: dict[str, set] = {}
    for p in PATHS:
        m = stream(p).meta
        if m["fault"]:
            assert m["level"] in fs.LEVELS and 0 <= m["fault_step"] < m["steps"] and "loss_note" in m
            faults.setdefault(m["template"], set()).add((m["setup"]["name"], m["split"]))
    want = {r.name for r in fs.RUNS if r.fault} | set(corpus.NEW_FAULTS)
    assert set(faults) == want
    for f, where in faults.items():
        held = any(sp == "heldout" for _, sp in where) or f in corpus.TUNING_ONLY
        assert len({s for s, _ in where}) >= 2 and held, (f, where)


def test_score_corpus_figures_add_up():
    """The harness on two streams with the default Monitor: its per-rule counts, rates and lead are
    the arithmetic of its own lists (and the loss rule's step is OLMo-core's on the same checks)."""
    pick = [p for p in PATHS if p.stem.startswith(("healthy.gpt2.bigram", "lr_x100.gpt2"))][:2]
    res = corpus.score_corpus("tuning", streams=[stream(p) for p in pick], cadence=50, heavy_every=500)
    h = res["healthy"]
    assert h["yellow"] == sum(c["YELLOW"] for c in h["rules"].values())
    assert h["yellow_per_20k"] == pytest.approx(h["yellow"] * 2e4 / h["steps"])
    for c in h["rules"].values():
        assert c["total"] == c["YELLOW"] + c["ORANGE"] + c["RED"] and c["policy"] != "?"
    for name, x in res["faults"].items():
        st = stream(CORPUS_DIR / x["split"] / f"{name}.npz")
        olmo = fs.OlmoLossSpike()
        fired = [s for s, m in fs.replay(st, 50) if olmo.update(s, m) and s >= x["fault_step"]]
        assert x["olmo"] == (fired[0] if fired else None)
        assert x["lead"] == fs.lead(x["olmo"], x["first_alert"], x["fault_step"], 50) or \
            (math.isnan(x["lead"]) and x["first_alert"] is None)


def test_the_scorers_policy_fields_exist_and_cover_every_default_rule():
    """``corpus.RULE_POLICY`` tells a user which ``Policy`` field tunes a noisy rule: each
    field it names is a ``Policy`` field, and every rule id the default rules can raise
    (each rule's ``name``, plus the ids a rule raises besides its own) has an entry."""
    import re

    import jvitals as vitals

    # The flat names: the keys of Policy.state_dict() (and the deprecated keywords).
    fields = set(vitals.Policy().state_dict())
    for rule, names in corpus.RULE_POLICY.items():
        for name in names.split(", "):
            assert re.sub(r"\[.*", "", name) in fields, (rule, name)
    # A rule's alerts carry its name, but for the two whose alerts carry finer ids (the rules
    # table in docs/MONITOR.md): SpikeRule and TrendRule.
    finer = {"spike": {"loss_spike", "periodic_spike"}, "trend": {"grad_trend", "param_norm"},
             "ratio": {"ratio", "grad_norm"}}
    ids = set().union(*(finer.get(r.name, {r.name}) for r in vitals.default_rules(vitals.Policy())))
    assert ids - set(corpus.RULE_POLICY) == set()


def test_blind_split_is_new():
    """The BLIND part (never tuned on): its model configurations, data sources, optimizers and
    schedules appear in no other part, at least one model family is new, its seeds are >= 2000
    and its own; at least 5 healthy streams and 20,000 healthy steps; ``load_split`` adds no
    fault_suite stream to it."""
    blind = _split("blind")
    others = _split("tuning") + _split("heldout")
    assert blind, "run `python benchmarks/corpus.py generate --split blind`"
    for key in ("model", "data", "optimizer", "schedule"):
        assert not {st.meta[key] for st in blind} & {st.meta[key] for st in others}, key
    assert {st.meta["model_family"] for st in blind} - {st.meta["model_family"] for st in others}
    fs_seeds = {r.seed for r in fs.RUNS + fs.EXTRA_RUNS}
    seeds = {st.meta["seed"] for st in blind}
    assert min(seeds) >= 2000 and not seeds & ({st.meta["seed"] for st in others} | fs_seeds)
    healthy = [st for st in blind if not st.meta["fault"]]
    assert len(healthy) >= 5 and sum(st.steps for st in healthy) >= 20_000
    loaded = corpus.load_split("blind", CORPUS_DIR)
    assert len(loaded) == len(blind) and all(st.meta["split"] == "blind" for st in loaded)
