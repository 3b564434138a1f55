"""Offline report of a training run's vital signs, read from TensorBoard event files.

Reads every event file under a log directory (written by any clu ``MetricWriter``) and
builds one self-contained HTML file: a level timeline with rollbacks, one plot per metric
family with the alert periods shaded, a per-layer gradient-share heat map, a replica x step
heat map of each per-replica figure, the monitor's alerts with diagnosis and prescription,
and the source guide's check-up table for the run's phase. The reading and plotting pieces
are public so that a notebook can use them (:mod:`jvitals.report.run`,
:mod:`jvitals.report.plots`, :mod:`jvitals.report.guide`); an example: docs/REPORT.md,
"The report's pieces in a notebook".
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import os
from typing import Any, Mapping

import numpy as np

from jvitals.report.writers import (
    ALERTS_MD_TAG,  # the same alerts as markdown: shown only without the JSON
    ALERTS_TAG,
    EVENTS_TAG,
    LEVEL_TAG,
    REPLICAS_TAG,
    ROLLBACK_COUNT as ROLLBACKS_TAG,
    ROLLBACK_LR_SCALE as LR_SCALE_TAG,
)
from jvitals.report.run import read_run, Run, run_name, to_int
from jvitals.report.plots import (
    FAMILIES,
    SHARE_PREFIX,
    plot_family,
    plot_layer_heatmap,
    plot_replica_heatmap,
    plot_timeline,
    replica_matrices,
    share_matrix,
)
from jvitals.report.guide import checkup, fmt, PHASES, planned_total_steps, run_phase



__all__ = [
    "build_html",
    "remedy_texts",
    "write_report",
]


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;
color:#1d1d1f;background:#fff;line-height:1.4}
h1{font-size:24px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;
padding-bottom:4px} h3{font-size:14px;margin:16px 0 6px}
table{border-collapse:collapse;width:100%;font-size:12.5px;margin:6px 0}
th,td{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
th{background:#f3f4f6} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.hdr td{border:none;padding:2px 12px 2px 0;font-size:14px} .hdr td:first-child{color:#666}
.lv{display:inline-block;padding:1px 7px;border-radius:9px;color:#fff;font-weight:600;font-size:12px}
.GREEN{background:#2e9d4f}.YELLOW{background:#f2c12e;color:#222}.ORANGE{background:#f08a24}
.RED{background:#d62d20}.unknown{background:#888}
.st{font-weight:700;white-space:nowrap} .PASSED{color:#1e7b3a} .FAILED{color:#c0261a}
.NOTMEASURED{color:#777}
img{max-width:100%;display:block;margin:6px 0 14px}
.src{color:#888;font-size:11px} .muted{color:#777;font-size:12px} pre{white-space:pre-wrap;
background:#f6f8fa;padding:8px;font-size:12px;max-height:300px;overflow:auto}
ul.loc{margin:0;padding-left:16px}
"""


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), (list, dict))
    except (TypeError, ValueError):
        return False


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fig_png(fig) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img(fig, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="{_fig_png(fig)}">'


def _figure(size):
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def _num(x) -> str:
    return _e(fmt(x)) if isinstance(x, (int, float, np.floating)) else _e(x)


def _lr_scale_text(run: Run) -> str:
    """``'1 -> 0.9 (from step 420)'``, or 'not measured' without ``rollback/lr_scale``."""
    s = run.series(LR_SCALE_TAG)
    if s is None or not np.isfinite(s[1]).any():
        return "not measured (no rollback/lr_scale: pass writer= to vitals.Rollback)"
    steps, vals = s[0][np.isfinite(s[1])], s[1][np.isfinite(s[1])]
    changes = [f"{fmt(vals[i])} from step {steps[i]}" for i in range(1, len(vals)) if vals[i] != vals[i - 1]]
    return f"{fmt(vals[0])}" + (" -> " + ", ".join(changes) if changes else " throughout")


def remedy_texts(rollback_event: Mapping[str, Any]) -> list[str]:
    """The remedies a ``rollback`` event applied (``'embedding LR x0.5'``, ...), in order.

    Read from the event's ``remedies`` list, else from its ``recovery`` steps of kind
    ``'remedy'`` (their ``text``); empty for a rollback without remedies.
    """
    got = rollback_event.get("remedies")
    if isinstance(got, list):
        return [str(x) for x in got]
    steps = _recovery_steps(rollback_event)
    if not isinstance(steps, list):
        return []
    return [str(a.get("text", a.get("remedy", ""))) for a in steps if _step_kind(a) == "remedy"]


def _recovery_steps(rollback_event: Mapping[str, Any]) -> Any:
    """A ``rollback`` event's steps after the restore (its ``recovery`` list; an older
    jvitals's log named it ``actions``)."""
    return rollback_event.get("recovery", rollback_event.get("actions"))


def _step_kind(step: Any) -> Any:
    """A recovery step's kind (``'restore'``, ``'lr_scale'``, ``'remedy'``, ...; ``action`` in
    an older jvitals's log); None for anything but a dict."""
    return step.get("kind", step.get("action")) if isinstance(step, Mapping) else None


def build_html(run: Run, *, title: str | None = None, phase: str | None = None,
               total_steps: int | None = None, all_phases: bool = True,
               checkpoint_every: int = 500) -> str:
    """The self-contained HTML report (PNG plots as ``data:`` URIs, every logged string escaped).

    Its sections, in order: the header table, the level timeline and the rollbacks,
    the vital signs (one plot per family, the per-layer share and per-replica heat
    maps), the alerts and the guard's events, the guide's check-up table, then every
    scalar and text not shown above.
    """
    title = title or f"jvitals report: {run_name(run.logdir)}"
    cur_phase = phase or run_phase(run, total_steps)
    p = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
         f"<style>{_CSS}</style></head><body>", f"<h1>{_e(title)}</h1>"]
    p += _header_section(run, cur_phase, given=bool(phase))
    if run.last_step is None:
        p.append("<p>No metrics were found in this directory.</p></body></html>")
        return "".join(p)
    p += _timeline_section(run)
    vitals, used = _vitals_section(run)
    p += vitals
    p += _alerts_section(run)
    p += _checkup_section(run, cur_phase, total_steps, all_phases, checkpoint_every)
    p += _other_metrics_section(run, used)
    p += _other_texts_section(run)
    p.append("</body></html>")
    return "\n".join(p)


def _header_section(run: Run, cur_phase: str, *, given: bool) -> list[str]:
    """When and from what the report was made, and the run at a glance."""
    alerts = run.alerts
    by_level = {n: sum(a["peak_level"] == n for a in alerts) for n in ("YELLOW", "ORANGE", "RED")}
    final = run.final_level
    p = [f"<p class='muted'>generated {_e(datetime.datetime.now().strftime('%Y-%m-%d %H:%M'))} "
         f"by jvitals from {len(run.files)} event file(s)</p>"]
    steps = f"{run.first_step} - {run.last_step}" if run.last_step is not None else "none"
    p.append("<table class='hdr'>")
    for k, v in (("run dir", _e(os.path.abspath(run.logdir))),
                 ("steps covered", _e(steps)),
                 ("final level", f"<span class='lv {_e(final)}'>{_e(final)}</span>"),
                 ("alerts", " ".join(f"<span class='lv {n}'>{n} {c}</span>" for n, c in by_level.items())
                  + f" <span class='muted'>({len(alerts)} in all)</span>"),
                 ("rollbacks", _e(run.num_rollbacks)),
                 ("LR scale", _e(_lr_scale_text(run))),
                 ("phase", _e(cur_phase) + (" <span class='muted'>(given)</span>" if given else
                                            " <span class='muted'>(from the steps; see the rule below)</span>")),
                 ("metrics logged", _e(len(run.scalars)) + " scalar tags, " + _e(len(run.texts)) + " text tags")):
        p.append(f"<tr><td>{k}</td><td>{v}</td></tr>")
    p.append("</table>")
    p += [f"<p class='muted'>reader: {_e(w)}</p>" for w in run.warnings]
    return p


def _timeline_section(run: Run) -> list[str]:
    """The level timeline, then one row per rollback (remedies apart from the other recovery steps)."""
    p = ["<h2>Timeline</h2>"]
    fig = _figure((12, 1.3))
    plot_timeline(run, fig.add_subplot())
    p.append(_img(fig, "level timeline"))
    rbs = run.rollbacks()
    if not rbs:
        return p
    p.append("<table><tr><th>rollback at step</th><th>restored step</th><th>earliest sign</th>"
             "<th>lr scale</th><th>remedies applied</th><th>recovery</th><th>reason</th></tr>")
    for r in rbs:
        steps = _recovery_steps(r) or []
        cures = remedy_texts(r)
        steps = "; ".join(", ".join(f"{k}={v}" for k, v in a.items()) if isinstance(a, Mapping) else str(a)
                          for a in steps if _step_kind(a) != "remedy"
                          ) if isinstance(steps, list) else str(steps)
        p.append(f"<tr><td class='num'>{_e(r.get('step'))}</td><td class='num'>{_e(r.get('to_step', ''))}</td>"
                 f"<td class='num'>{_e(r.get('onset_step', ''))}</td>"
                 f"<td class='num'>{_num(r.get('lr_scale', ''))}</td>"
                 f"<td>{_e('; '.join(cures) or 'none')}</td><td>{_e(steps)}</td>"
                 f"<td>{_e(r.get('reason', ''))}</td></tr>")
    p.append("</table>")
    return p


def _vitals_section(run: Run) -> tuple[list[str], set[str]]:
    """One plot per family present, the per-layer share and per-replica heat maps;
    also the scalar tags they showed (the rest go to "Other metrics")."""
    p = ["<h2>Vital signs</h2><p class='muted'>Shaded: the monitor's yellow/orange/red periods; "
         "dashed dark red lines: rollbacks; red x: non-finite values; faint dots: values overwritten "
         "after a restart.</p>"]
    used = {LEVEL_TAG, ROLLBACKS_TAG}
    missing = []
    for fam in FAMILIES:
        tags = fam.present(run)
        if not tags:
            missing.append(fam.title)
            continue
        used.update(tags)
        fig = _figure((12, 2.5))
        plot_family(run, fam, fig.add_subplot())
        p.append(_img(fig, fam.title))
    p.append("<h3>Per-layer gradient share</h3>")
    got = share_matrix(run)
    if got is not None:
        used.update(t for _, t in run.layer_tags(SHARE_PREFIX))
        fig = _figure((12, max(2.2, 0.25 * len(got[0]) + 1.2)))
        plot_layer_heatmap(run, fig.add_subplot())
        p.append(_img(fig, "per-layer gradient share heat map"))
    else:
        p.append("<p class='muted'>not measured (no grad/share/layer_* or grad/norm/layer_*)</p>")
    p += _replica_heatmaps(run, used)
    if missing:
        p.append(f"<p class='muted'>Not measured (no tags logged): {_e('; '.join(missing))}.</p>")
    return p, used


def _replica_heatmaps(run: Run, used: set[str]) -> list[str]:
    """A replica x step heat map per per-replica figure (adds the ``replica/*`` tags to ``used``)."""
    reps = replica_matrices(run)
    if not reps:
        return []
    p = ["<h3>Per-replica figures</h3><p class='muted'>Each data-parallel replica (row) against "
         "the others at each step (column): robust z-scores, clipped; a sick device is a bright "
         "row, a bad data shard a bright trail that moves between replicas with the data.</p>"]
    for fig_name in [f for f in reps if f not in ("data", "first_nonfinite_step")]:
        fig = _figure((12, max(2.2, 0.18 * reps[fig_name][1].shape[0] + 1.2)))
        plot_replica_heatmap(run, fig_name, fig.add_subplot())
        p.append(_img(fig, f"replica/{fig_name} heat map"))
    used.update(t for t in run.scalars if t.startswith("replica/"))
    return p


def _alerts_section(run: Run) -> list[str]:
    """Every alert at its peak (value / baseline, cause, prescription, localization), then the guard's events."""
    p = ["<h2>Alerts</h2>"]
    if not run.alerts:
        p.append("<p>No alerts were logged.</p>")
    else:
        p.append("<table><tr><th>step</th><th>level</th><th>metric</th><th>rule</th><th>value / baseline"
                 "</th><th>message</th><th>cause</th><th>prescription</th><th>localization</th></tr>")
        for a in run.alerts:
            lvl = a["peak_level"]
            onset = f" (onset {a['onset_step']})" if a["onset_step"] is not None else ""
            if to_int(a.get("closed_step")) is not None:
                onset += f", closed {a['closed_step']}"
            vb = f"{fmt(a['value'])} / {fmt(a['baseline'])}"
            if np.isfinite(a["ratio"]):
                vb += f" (x{fmt(a['ratio'])})"
            loc = "".join(f"<li>{_e(x)}</li>" for x in a["localization"])
            p.append(f"<tr><td class='num'>{_e(a['step'])}{_e(onset)}</td>"
                     f"<td><span class='lv {_e(lvl)}'>{_e(lvl)}</span></td><td>{_e(a['metric'])}</td>"
                     f"<td>{_e(a['rule'])}</td><td class='num'>{_e(vb)}</td><td>{_e(a['message'])}</td>"
                     f"<td>{_e(a['cause'])}</td><td>{_e(a['prescription'])}</td>"
                     f"<td><ul class='loc'>{loc}</ul></td></tr>")
        p.append("</table>")
    other_events = [e for e in run.events if e.get("event") not in ("rollback",)]
    if other_events:
        p.append("<h3>Guard events</h3><table><tr><th>step</th><th>event</th><th>details</th></tr>")
        for e in other_events:
            det = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("step", "event"))
            p.append(f"<tr><td class='num'>{_e(e['step'])}</td><td>{_e(e['event'])}</td><td>{_e(det)}</td></tr>")
        p.append("</table>")
    return p


def _checkup_section(run: Run, cur_phase: str, total_steps: int | None, all_phases: bool,
                     checkpoint_every: int) -> list[str]:
    """The guide's check-up table, this run's phase first, each item judged over its phase's window."""
    total = planned_total_steps(run, total_steps)
    p = ["<h2>Check-up</h2>",
         "<p class='muted'>The guide's check-up table (seed 003, §6.2). Phase rule: start-up = steps "
         "0-1000; middle = step 1000 to the middle of training; late = the second half. The run's last "
         f"step is {_e(run.last_step)}; planned total steps: {_e(total if total else 'unknown (pass --total-steps)')}"
         ". Each phase's items are judged over that phase's window of steps.</p>"]
    items = checkup(run, cur_phase, total_steps=total_steps, all_phases=all_phases,
                    checkpoint_every=checkpoint_every)
    for ph in [cur_phase] + [x for x in PHASES if x != cur_phase]:
        rows = [it for it in items if it.phase == ph]
        if not rows:
            continue
        label = "this run's phase" if ph == cur_phase else "other phase"
        reached = ph == cur_phase or PHASES.index(ph) <= PHASES.index(run_phase(run, total_steps))
        where = f"window steps {rows[0].window[0]}-{rows[0].window[1]}" if reached else "not reached"
        p.append(f"<h3>{_e(ph)} <span class='muted'>({_e(label)}; {_e(where)})</span></h3>")
        p.append("<table><tr><th style='width:34%'>item <span class='muted'>(hover: the guide's wording)</span></th><th style='width:11%'>result</th>"
                 "<th>deciding figure</th></tr>")
        for it in rows:
            p.append(f"<tr><td title='{_e(it.source)}' lang='en'>{_e(it.text)}</td>"
                     f"<td class='st {it.status.replace(' ', '')}'>{_e(it.status)}</td>"
                     f"<td>{_e(it.figure)}</td></tr>")
        p.append("</table>")
    return p


def _other_metrics_section(run: Run, used: set[str]) -> list[str]:
    """Every scalar tag no plot showed: points, range, last value, non-finite count."""
    rest = sorted(t for t in run.scalars if t not in used)
    if not rest:
        return []
    p = ["<h2>Other metrics</h2><table><tr><th>tag</th><th>points</th><th>first step</th>"
         "<th>last step</th><th>last</th><th>min</th><th>max</th><th>non-finite</th></tr>"]
    for t in rest:
        s, v = run.scalars[t]
        fin = v[np.isfinite(v)]
        mn, mx = (fmt(fin.min()), fmt(fin.max())) if len(fin) else ("-", "-")
        p.append(f"<tr><td>{_e(t)}</td><td class='num'>{len(s)}</td><td class='num'>{s[0]}</td>"
                 f"<td class='num'>{s[-1]}</td><td class='num'>{_num(float(v[-1]))}</td>"
                 f"<td class='num'>{_e(mn)}</td><td class='num'>{_e(mx)}</td>"
                 f"<td class='num'>{int((~np.isfinite(v)).sum())}</td></tr>")
    p.append("</table>")
    return p


def _other_texts_section(run: Run) -> list[str]:
    """Text tags not shown above (and alert/event records that did not parse), each its last record."""
    skip = {ALERTS_TAG, EVENTS_TAG, REPLICAS_TAG} | ({ALERTS_MD_TAG} if ALERTS_TAG in run.texts else set())
    shown = {t: recs for t, recs in run.texts.items() if t not in skip}
    for t in (ALERTS_TAG, EVENTS_TAG):
        bad = [(st, x) for st, x in run.texts.get(t, []) if not _parses(x)]
        if bad:
            shown[t + " (unparsed)"] = bad
    if not shown:
        return []
    p = ["<h2>Other texts</h2>"]
    for t in sorted(shown):
        recs = shown[t]
        p.append(f"<h3>{_e(t)} <span class='muted'>({len(recs)} record(s); last shown)</span></h3>")
        step, s = recs[-1]
        p.append(f"<pre>step {_e(step)}:\n{_e(s[:20000])}</pre>")
    return p


def write_report(logdir: str | os.PathLike, out: str | os.PathLike, *, title: str | None = None,
                 phase: str | None = None, total_steps: int | None = None,
                 checkpoint_every: int = 500) -> str:
    """Reads ``logdir`` and writes the HTML report to ``out``; returns ``out``."""
    run = read_run(logdir)
    doc = build_html(run, title=title, phase=phase, total_steps=total_steps,
                     checkpoint_every=checkpoint_every)
    out = os.fspath(out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(doc)
    return out
