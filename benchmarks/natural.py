"""The natural-instability corpus: runs whose instability comes from their settings, each beside a control.

Every fault the other corpora hold is injected at a known step. The runs here break (or not)
by themselves, as the literature's small-scale proxies do (Wortsman et al. 2023, arXiv
2309.14322; Dehghani et al. 2023; Chowdhery et al. 2022): a **sick** run and its **control**
differ in one setting (qk-layernorm, the z-loss, Adam's epsilon, the warm-up, the precision,
the data's order), on several model shapes (dense, MoE, MLA; Linen and NNX; ``natural_models``)
and texts. Each run is recorded as the README loop sees it (``natural_train``) into
``tests/data/natural/{split}/{name}.npz`` with, under ``check/``, the corpus' own measurements
that confirm the instability without the monitor (attention entropy, log Z, the update RMS per
unit learning rate).

Scoring replays each stream through a fresh ``jvitals.Monitor()`` at a check every 10 steps
(heavy family every 50) and at the README's cadence (every 50, heavy every 500), as
``benchmarks/windows.py`` rebuilds the host's view, and asks of each pair:

- **sick**: the first alert, its step against the step the loss separates from the
  control's (the first step from which the sick run's 51-step mean loss stays more than
  ``SEPARATION`` above the control's for ``SEPARATION_HOLD`` steps), and whether it names the
  cause (its rule among ``CAUSE_RULES[kind]``);
- **control**: its YELLOWs and its ORANGE/RED alerts (none asked, at most one YELLOW).

Splits: ``tuning`` (the rules were set on it), ``heldout`` (other shapes, texts, seeds and
learning rates; scored, not tuned on: one held-out control's YELLOW led to a change of the
attention rule, docs/DIAGNOSIS.md says which), ``blind`` (defined after the rules were set,
generated and scored once).

    python benchmarks/natural.py generate [--split tuning] [--only NAME ...] [--jobs 2]
    python benchmarks/natural.py score [--split heldout] [--cadence 10 --heavy-every 50]
    python benchmarks/natural.py list
    python benchmarks/natural.py table   # every pair at both cadences (docs/DIAGNOSIS.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

import fault_suite as fs
import windows

ROOT = Path(__file__).resolve().parents[1]
NATURAL = ROOT / "tests" / "data" / "natural"
SPLITS = ("tuning", "heldout", "blind")
SEPARATION = 0.02
SEPARATION_HOLD = 200
FREE_EVERY = 10      # per-layer and per-group figures stored every 10 steps (every check at 10)

CAUSE_RULES: Mapping[str, tuple[str, ...]] = {
    "attn_logits": ("attn_logits", "logits"),
    "output_logits": ("output_logits", "logits"),
    "adam_eps": ("update_size",),
    "no_warmup": ("update_size", "early"),
    "loss_scale": ("loss_scale", "nonfinite", "skip"),
    "data_shard": ("repeat", "data", "loss_spike", "val_rise", "val_gap"),
}
"""The rules whose alert names each kind's cause."""


@dataclasses.dataclass(frozen=True)
class Pair:
    """A sick run and its control: ``base`` settings, ``sick`` and ``control`` the one that differs.

    Settings are :class:`natural_train.Spec` fields; ``model.<field>`` sets a model field.
    """

    kind: str
    shape: str
    split: str
    seed: int
    base: Mapping[str, Any]
    sick: Mapping[str, Any]
    control: Mapping[str, Any]
    note: str = ""

    def name(self, arm: str) -> str:
        return f"{self.kind}.{self.shape}.{arm}.s{self.seed}"


def _pairs() -> list[Pair]:
    qk = {"model.qk_norm": True, "steps": 1500}
    no_qk, with_qk = {"model.qk_norm": False}, {"model.qk_norm": True}
    short = {"steps": 1500}
    return [
        # TUNING: the rules were set on these.
        Pair("attn_logits", "linen-dense", "tuning", 0, dict(lr=3e-2, data="pystdlib"), no_qk, with_qk),
        Pair("attn_logits", "nnx-dense", "tuning", 1, dict(lr=3e-2, api="nnx", data="pydocs", **short), no_qk, with_qk),
        Pair("attn_logits", "linen-moe", "tuning", 2, dict(lr=3e-2, data="pystdlib", **short, **{"model.n_experts": 4}),
             no_qk, with_qk),
        Pair("no_warmup", "linen-dense", "tuning", 3, dict(lr=3e-2, data="pystdlib", **qk),
             {"warmup": 0}, {"warmup": 200}),
        Pair("data_shard", "linen-dense", "tuning", 4, dict(lr=1e-2, data="pystdlib", **qk),
             {"repeat": (800, 1100, 16)}, {"repeat": ()},
             note="the loader serves the same 16 sequences from step 800 to 1100"),
        Pair("output_logits", "linen-dense", "tuning", 5,
             dict(lr=3e-2, wd=0.0, data="pydocs", **qk, **{"model.logits_dtype": "bfloat16"}),
             {"z_loss": 0.0}, {"z_loss": 1e-4},
             note="PaLM's setting at this size (no z-loss, no weight decay, bf16 logits, high LR)"),
        Pair("adam_eps", "linen-dense", "tuning", 6, dict(lr=1e-2, data="pystdlib", **qk), {"eps": 1e-2}, {"eps": 1e-8}),
        # HELD-OUT: other shapes, texts, seeds and learning rates; scored, not tuned on.
        Pair("attn_logits", "linen-mla", "heldout", 100, dict(lr=5e-2, data="pydocs", **{"model.attention": "mla"}),
             no_qk, with_qk),
        Pair("attn_logits", "nnx-moe", "heldout", 101,
             dict(lr=3e-2, api="nnx", data="pysite", **short, **{"model.n_experts": 4, "model.n_layers": 2}),
             no_qk, with_qk),
        Pair("attn_logits", "linen-wide", "heldout", 102,
             dict(lr=2e-2, data="markov2", **short, **{"model.d_model": 96, "model.n_heads": 6, "model.n_layers": 4}),
             no_qk, with_qk),
        Pair("no_warmup", "nnx-dense", "heldout", 103, dict(lr=2e-2, api="nnx", data="pysite", **qk),
             {"warmup": 0}, {"warmup": 300}),
        Pair("data_shard", "nnx-dense", "heldout", 104, dict(lr=1e-2, api="nnx", data="pydocs", **qk),
             {"repeat": (1000, 1300, 8)}, {"repeat": ()},
             note="the loader serves the same 8 sequences from step 1000 to 1300"),
        Pair("adam_eps", "nnx-dense", "heldout", 105, dict(lr=1e-2, api="nnx", data="pydocs", **qk),
             {"eps": 3e-2}, {"eps": 1e-8}),
        # BLIND: defined after the rules were set, generated and scored once.
        Pair("attn_logits", "nnx-mla", "blind", 200,
             dict(lr=4e-2, api="nnx", data="pysite", **short, **{"model.attention": "mla"}), no_qk, with_qk),
        Pair("attn_logits", "linen-deep", "blind", 201,
             dict(lr=2e-2, warmup=300, data="pydocs", **short, **{"model.n_layers": 5}), no_qk, with_qk),
        Pair("no_warmup", "linen-moe", "blind", 202, dict(lr=3e-2, data="pydocs", **qk, **{"model.n_experts": 4}),
             {"warmup": 0}, {"warmup": 200}),
    ]


PAIRS = _pairs()


def spec_of(pair: Pair, arm: str) -> Any:
    """The :class:`natural_train.Spec` of one arm (imports JAX)."""
    import natural_models as nm
    import natural_train as nt

    kw = {**pair.base, **(pair.sick if arm == "sick" else pair.control)}
    model = {k[6:]: v for k, v in kw.items() if k.startswith("model.")}
    rest = {k: v for k, v in kw.items() if not k.startswith("model.")}
    return nt.Spec(name=pair.name(arm), kind=pair.kind, arm=arm, model=nm.NatConfig(**model), seed=pair.seed,
                   split=pair.split, setting=json.dumps(pair.sick if arm == "sick" else pair.control,
                                                        sort_keys=True), **rest)


def stream_path(pair: Pair, arm: str, root: Path = NATURAL) -> Path:
    return root / pair.split / f"{pair.name(arm)}.npz"


def _thin_rows(rows: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
    """What is stored: every step's light figures; per-layer and per-group figures every
    ``FREE_EVERY`` steps; the heavy family where it was computed; the checks every 10 steps."""
    out = []
    for s, r in enumerate(rows):
        keep = s % FREE_EVERY == 0
        out.append({k: v for k, v in r.items()
                    if keep or not (k.startswith("check/") or "/layer_" in k or k.endswith(("/embedding", "/lm_head")))})
    return out


def generate(pairs: Sequence[Pair], root: Path = NATURAL, arms: Sequence[str] = ("sick", "control"),
             skip_existing: bool = True) -> None:
    import natural_train as nt

    for pair in pairs:
        for arm in arms:
            path = stream_path(pair, arm, root)
            if skip_existing and path.exists():
                continue
            spec = spec_of(pair, arm)
            rows, facts = nt.train(spec)
            meta = dict(name=pair.name(arm), kind=pair.kind, shape=pair.shape, arm=arm, split=pair.split,
                        seed=pair.seed, spec=spec.describe(), facts=facts, layers_every=spec.heavy_every,
                        note=pair.note)
            fs.save_stream(path, meta, _thin_rows(rows))
            print(f"wrote {path} ({facts['wall_s']:.0f} s)", flush=True)


# ----------------------------------------------------------------------------------
# Scoring (NumPy and the monitor only).


def load(split: str, root: Path = NATURAL) -> dict[str, fs.Stream]:
    d = Path(root) / split
    return {st.name: st for st in fs.load_streams(d)} if d.exists() else {}


def monitored(stream: fs.Stream) -> fs.Stream:
    """The stream without the corpus' own ``check/`` measurements (the monitor never sees them)."""
    return fs.Stream(meta=stream.meta, steps=stream.steps,
                     series={k: v for k, v in stream.series.items() if not k.startswith("check/")})


def smoothed_loss(stream: fs.Stream, width: int = 51) -> np.ndarray:
    x = stream.dense("loss")
    ok = np.isfinite(x)
    k = np.ones(width)
    num = np.convolve(np.where(ok, x, 0.0), k, mode="same")
    den = np.convolve(ok.astype(float), k, mode="same")
    return num / np.maximum(den, 1)


def separation_step(sick: fs.Stream, control: fs.Stream) -> int | None:
    """The first step from which the sick run's smoothed loss stays more than ``SEPARATION``
    above the control's for ``SEPARATION_HOLD`` steps (None: never)."""
    a, b = smoothed_loss(sick), smoothed_loss(control)
    n = min(len(a), len(b))
    above = a[:n] > (1 + SEPARATION) * b[:n]
    for s in range(n - SEPARATION_HOLD):
        if above[s] and above[s: s + SEPARATION_HOLD].all():
            return s
    return None


def replay_alerts(stream: fs.Stream, cadence: int, heavy_every: int, monitor_factory: Any = None
                  ) -> list[dict[str, Any]]:
    """Every alert opening or escalating: ``{step, level, rule, metric, prescription}``."""
    from jvitals.monitor.monitor import Monitor

    mon = (monitor_factory or Monitor)()
    seen: dict[int, int] = {}
    out = []
    for s, m in windows.replay(windows.thin(monitored(stream), heavy_every), cadence):
        v = mon.update(s, m)
        for a in v.alerts:
            if int(a.level) > seen.get(a.id, 0):
                seen[a.id] = int(a.level)
                out.append(dict(step=s, level=a.level.name, rule=a.rule, metric=a.metric,
                                prescription=getattr(a, "prescription", ""), message=a.message))
    return out


def score_pair(pair: Pair, streams: Mapping[str, fs.Stream], cadence: int, heavy_every: int) -> dict[str, Any]:
    sick, ctrl = streams.get(pair.name("sick")), streams.get(pair.name("control"))
    if sick is None or ctrl is None:
        return dict(pair=pair.name("*"), missing=True)
    sep = separation_step(sick, ctrl)
    sa, ca = replay_alerts(sick, cadence, heavy_every), replay_alerts(ctrl, cadence, heavy_every)
    first = sa[0] if sa else None
    named = bool(first) and first["rule"] in CAUSE_RULES.get(pair.kind, ())
    return dict(pair=pair.name("*"), kind=pair.kind, shape=pair.shape, separation=sep,
                first=first, named=named, before=bool(first) and (sep is None or first["step"] < sep),
                sick_levels=sorted({a["level"] for a in sa}),
                control_yellow=sum(a["level"] == "YELLOW" for a in ca),
                control_orange_red=sum(a["level"] in ("ORANGE", "RED") for a in ca),
                control_alerts=[f"{a['step']} {a['level']} {a['rule']}:{a['metric']}" for a in ca])


def score(split: str, cadence: int, heavy_every: int, root: Path = NATURAL) -> list[dict[str, Any]]:
    streams = load(split, root)
    return [score_pair(p, streams, cadence, heavy_every) for p in PAIRS if p.split == split]


def format_scores(rows: Sequence[Mapping[str, Any]], title: str) -> str:
    out = [f"## {title}", "",
           "| pair | loss separates | first alert on the sick run | names the cause | before | control |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("missing"):
            out.append(f"| {r['pair']} | (not generated) | | | | |")
            continue
        f = r["first"]
        fa = f"{f['step']} {f['level']} {f['rule']}:{f['metric']}" if f else "none"
        ctrl = "; ".join(r["control_alerts"]) or "quiet"
        out.append(f"| {r['pair']} | {r['separation']} | {fa} | {'yes' if r['named'] else 'NO'} | "
                   f"{'yes' if r['before'] else 'NO'} | {ctrl} |")
    return "\n".join(out)


def summary_table(root: Path = NATURAL) -> str:
    """One markdown table of every pair at both cadences (docs/DIAGNOSIS.md)."""
    rows = ["| split | pair | loss separates | first alert on the sick run, every 10 / every 50 (heavy 500) | "
            "names the cause, before | the control (both cadences) |", "|---|---|---|---|---|---|"]
    for split in SPLITS:
        streams = load(split, root)
        for p in (p for p in PAIRS if p.split == split):
            a, b = (score_pair(p, streams, c, h) for c, h in ((10, 50), (50, 500)))
            if a.get("missing"):
                continue
            firsts = " / ".join(f"{r['first']['step']} {r['first']['level']} {r['first']['rule']}" if r["first"]
                                else "none" for r in (a, b))
            ok = "yes" if a["named"] and b["named"] and a["before"] and b["before"] else (
                "named, after" if a["named"] and b["named"] else "NO")
            ctrl = "; ".join(sorted(set(a["control_alerts"]) | set(b["control_alerts"]))) or "quiet"
            rows.append(f"| {split} | {p.kind} {p.shape} s{p.seed} | {a['separation']} | {firsts} | {ok} | {ctrl} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--split", choices=SPLITS)
    g.add_argument("--only", nargs="*", help="pair names (kind.shape.*.sSEED) or kinds")
    g.add_argument("--arm", choices=("sick", "control"))
    g.add_argument("--force", action="store_true")
    s = sub.add_parser("score")
    s.add_argument("--split", choices=SPLITS, default="tuning")
    s.add_argument("--cadence", type=int, default=50)
    s.add_argument("--heavy-every", type=int, default=500)
    s.add_argument("--json", default="")
    sub.add_parser("list")
    sub.add_parser("table", help="every pair at both cadences, as docs/DIAGNOSIS.md shows them")
    args = ap.parse_args(argv)
    if args.cmd == "table":
        print(summary_table())
        return 0
    if args.cmd == "list":
        for p in PAIRS:
            print(f"{p.split:8s} {p.name('*'):40s} sick {dict(p.sick)} control {dict(p.control)}")
        return 0
    if args.cmd == "generate":
        pairs = [p for p in PAIRS if (args.split is None or p.split == args.split)
                 and (not args.only or p.name("*") in args.only or p.kind in args.only)]
        generate(pairs, arms=(args.arm,) if args.arm else ("sick", "control"), skip_existing=not args.force)
        return 0
    rows = score(args.split, args.cadence, args.heavy_every)
    print(format_scores(rows, f"{args.split}: checks every {args.cadence}, heavy every {args.heavy_every}"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
