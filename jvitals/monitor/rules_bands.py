"""Figures against their own band: a group (:class:`GroupRule`), the logits
(:class:`LogitRule`) and the router (:class:`RouterRule`).
"""

from __future__ import annotations

import math

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.policy import Policy
from jvitals.monitor.robust import median
from jvitals.monitor.rules_base import Figures
from jvitals.monitor.trackers_bands import BandSettings, DriftBand
from jvitals.monitor.types import Change, Level, Reading, RuleBase, Spike, release, set_, split_group

__all__ = ["GroupRule", "LogitRule", "RouterRule"]

_GLOBAL_OF = {"update/param_ratio": "update/param_ratio", "param/norm": "param/global_norm"}


class GroupRule(RuleBase):
    """One group's figure departed from its own history while the global figures did not.

    Groups: ``embedding``, ``lm_head``, ``layer_{i}``; figures ``{family}/{group}``
    for the families of ``Policy.bands.group_bands``. Each value is divided by the trunk's
    median of the family at the same check (the global figure where no layer figure
    is logged; the embedding's and the LM head's update ratios by the learning rate
    where ``lr_metric`` is logged, so that every layer's update moving together, as
    an attention LR fault makes them, is not read as theirs), so a schedule moving
    every group together is not a departure, and
    ``y = log(x / trunk)`` is judged against its own history by a
    :class:`~jvitals.monitor.trackers_bands.DriftBand` (``band`` = the family's
    ``group_bands`` ratio, ``W = group_window``)::

        jump   |y - y_prev| >= max(log(group_jump), group_z * noise)     YELLOW at once
        step   |y - y_prev| >  max(log(band), group_z * noise)           2 samples
        drift  |y - y(t - W)| > max(log(band), group_drift_k * D_W)      2 samples
               for W = group_window or 4 x group_window
        growth y - y(t - W) > log(band) and >= y(t - W) - y(t - 2W)      2 samples
               (the families of group_growth: a rise that does not slow)

    (``noise``: the RMS of its one-sample changes; ``D_W``: the largest change over
    ``W`` steps it showed earlier in the run, up to ``W`` steps ago, fading with
    half-life ``drift_memory``). Gradient shares are judged for drift only: one
    batch of real text moves them 5x and back (the update ratios and the param
    norms show an abrupt fault; the shares follow). So the natural drift of a group (shares moving
    between layers as the model learns, the head's share rising) is no alert; an
    abrupt departure, or a drift well beyond the group's own, is. The YELLOW names
    the group (embedding / LM head: "0.5x trunk LR"; a layer: "layer-wise LR
    decay") and opens only while ``grad/global_norm`` (against the schedule's
    prediction) and ``param/global_norm`` are below ``group_global_ratio`` x their
    baselines; it is released when the figure is back within ``hysteresis x
    log(band)`` of the level it left.
    """

    name = "group"
    alert_ids = ("group",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("bands",)
    state_types = {"bands": DriftBand}

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.bands: dict[str, DriftBand] = {}

    def _plan(self, f: Figures):
        got = f.plan.cache.get(self.name)
        if got is None:
            fams: dict[str, list[tuple[str, str, bool, int]]] = {}
            for i, k in enumerate(f.plan.keys):
                sg = split_group(k)
                if sg and sg[0] in self.p.bands.group_bands:
                    fams.setdefault(sg[0], []).append((k, sg[1], sg[2] is not None, i))
            got = f.plan.cache[self.name] = fams
        return got

    def _observe(self, f: Figures, fams) -> tuple[dict[str, tuple], set[str]]:
        """Feeds every group figure to its band; ``({group: strongest hit}, groups seen)``."""
        p, s = self.p, f.step
        windows = (p.bands.group_window, 4 * p.bands.group_window)
        hits: dict[str, tuple] = {}
        seen: set[str] = set()
        for fam, items in fams.items():
            vals = [(k, g, is_layer, float(f.vals[i])) for k, g, is_layer, i in items]
            layer_vals = [v for _, _, is_layer, v in vals if is_layer and v > 0 and math.isfinite(v)]
            if fam == "grad/share":
                trunk = 1.0     # shares are relative already (a tiny trunk share makes any ratio huge)
            elif len(layer_vals) >= 2:
                trunk = median(layer_vals)
            elif fam in _GLOBAL_OF:
                trunk = f.get(_GLOBAL_OF[fam]) or _NAN
            else:
                trunk = 1.0
            if not (trunk > 0 and math.isfinite(trunk)):
                continue
            band = p.bands.group_bands[fam]
            lr = f.get(p.baselines.lr_metric) if fam == "update/param_ratio" else None
            per_lr = lr is not None and math.isfinite(lr) and lr > 0
            floor = p.bands.group_min_share if fam == "grad/share" else 0.0
            for k, g, is_layer, v in vals:
                if not (v > 0 and math.isfinite(v)):
                    continue
                seen.add(g)
                b = self.bands.get(k)
                if b is None:
                    b = self.bands[k] = DriftBand()
                # The embedding's and the head's update ratios per unit LR (the schedule
                # cancels; a change of every layer's, e.g. the attention's LR, does not
                # read as theirs); a layer's relative to the trunk.
                norm = lr if per_lr and not is_layer else trunk
                rel = ("per unit LR" if norm is lr else "as it is" if trunk == 1.0
                       else "relative to the trunk's median")
                y = math.log(v / norm)
                if b.observe(s, f.t, y, BandSettings(band, p.bands.group_jump, p.bands.group_z,
                                                     p.bands.group_drift_k, windows, p.bands.drift_memory,
                                                     p.bands.group_confirm, p.alerts.hysteresis,
                                                     abrupt=fam != "grad/share",
                                                     growth=fam in p.bands.group_growth)):
                    if max(v, norm * math.exp(b.anchor)) < floor:
                        continue   # a share below group_min_share before and after: noise
                    size = abs(y - b.anchor) / math.log(band)
                    if g not in hits or size > hits[g][0]:
                        hits[g] = (size, k, fam, v, norm * math.exp(b.anchor), math.exp(y - b.anchor), b,
                                   rel)
        return hits, seen

    def _headline(self, g: str, k: str, fam: str, v: float, ref: float, r: float,
                  b: DriftBand, rel: str) -> str:
        p = self.p
        band = p.bands.group_bands[fam]
        if b.kind == "growth":
            rise, before = b.last_rise(b.window) or (b.stat, math.nan)
            why = (f"it grew {math.exp(rise):.2f}x over the last {b.window} steps, beyond its band "
                   f"group_bands[{fam!r}] = {band:g}x, and did not slow: {math.exp(before):.2f}x over "
                   f"the {b.window} steps before (group_growth); a healthy group's growth slows as "
                   "training settles")
        elif b.kind == "drift":
            i = 0 if b.window == p.bands.group_window else 1
            nat = b.natural(i, (p.bands.group_window, 4 * p.bands.group_window), b.last_t) or 0.0
            why = (f"it changed {math.exp(abs(b.stat)):.2f}x over the last {b.window} steps, "
                   f"beyond group_drift_k = {p.bands.group_drift_k:g} x the largest change over "
                   f"{b.window} steps it showed before in this run ({math.exp(nat):.2f}x) and "
                   f"its band group_bands[{fam!r}] = {band:g}x (windows: group_window and 4x it)")
        else:
            noise = b.noise
            nz = f" and > group_z = {p.bands.group_z:g} x its sample-to-sample noise ({noise:.2g} in log)" \
                if noise is not None else ""
            lim = (f"an unmistakable departure: >= group_jump = {p.bands.group_jump:g}x" if b.kind == "jump"
                   else f"beyond its band group_bands[{fam!r}] = {band:g}x")
            why = f"it moved {math.exp(abs(b.stat)):.2f}x in one sample ({lim}{nz})"
        layer = g.startswith("layer_")
        what = "layer-wise LR decay" if layer else "embedding and LM head at 0.5x trunk LR"
        return (f"the {g} group left its own band while the global figures did not: {k} = {v:.4g} "
                f"is {r:.2f}x the level it left ({ref:.4g}; judged {rel}); {why}. "
                f"Suggests {what}.")

    def check(self, f: Figures) -> list[Change]:
        fams = self._plan(f)
        if not fams or f.warm:
            return []
        p = self.p
        hits, seen = self._observe(f, fams)
        changes = []
        ratios = f.notes.ratio
        calm = all(ratios.get(m, 1.0) < p.bands.group_global_ratio
                   for m in ("grad/global_norm", "param/global_norm"))
        for g in sorted(seen):
            hit = hits.get(g)
            active = f.active("group", g) is not None
            if hit is None:
                if ("group", g) in f.open:
                    changes.append(release("group", g))
                continue
            if not active and not calm:
                continue
            _, k, fam, v, ref, r, b, rel = hit
            layer = g.startswith("layer_")
            changes.append(set_(
                "group", k, Level.YELLOW, Reading(v, ref, r), self._headline(g, k, fam, v, ref, r, b, rel),
                f"{k} left its band", key=g, onset=None if active else b.onset,
                prescription="group_layer_lr" if layer else "group_embedding_lr",
                details={"group": g, "family": fam, "kind": b.kind}))
        return changes

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        for b in self.bands.values():
            b.rewind(t_to)
        return []


class LogitRule(RuleBase):
    """Logits growing beyond their own drift: the attention's (no QK-norm, Wq/Wk LR
    too high) and the output's (logit drift).

    For each ``(metric, band)`` of ``Policy.bands.logit_bands`` (``act/attn_logits_abs.max``,
    ``act/output_layer_logits_abs.max``), the metric and its per-layer figures
    (``{metric}/layer_{i}``) are judged as the group rule judges a group figure, on
    ``y = log(x)`` with a :class:`~jvitals.monitor.trackers_bands.DriftBand` (its
    ``group_*`` settings): a one-sample jump ``>= group_jump`` x (and ``group_z`` x
    its noise) opens at once; a step beyond ``band`` or a rise over
    ``group_window`` (or 4x it) beyond ``group_drift_k`` x the rise the figure
    showed before opens after ``group_confirm`` samples. Only rises count (logits
    shrinking is no fault). Attention logits grow 10-50x over a healthy run's
    first thousand steps: that is the figure's own drift (cold start, fading with
    ``drift_memory``). A figure logged more often is judged once per ``group_window
    // 16`` steps. YELLOW; the guard's default remedies turn QK-clip (attention) or
    z-loss (output) on.
    """

    name = "logits"
    alert_ids = ("logits",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("bands", "last_t")
    state_types = {"bands": DriftBand}

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.bands: dict[str, DriftBand] = {}
        self.last_t = -(10 ** 9)

    def _plan(self, f: Figures) -> list[tuple[str, str, int]]:
        got = f.plan.cache.get(self.name)
        if got is None:
            got = []
            for i, k in enumerate(f.plan.keys):
                for m in self.p.bands.logit_bands:
                    if k == m or (k.startswith(m + "/layer_") and k[len(m) + 7:].isdigit()):
                        got.append((m, k, i))
            got = f.plan.cache[self.name] = got
        return got

    def check(self, f: Figures) -> list[Change]:
        items = self._plan(f)
        p = self.p
        stride = max(1, p.bands.group_window // 16)
        if f.warm or not items or 0 <= f.t - self.last_t < stride:
            return []       # logged more often than a stride: judged once per stride
        self.last_t = f.t
        s, out = f.step, []
        windows = (p.bands.group_window, 4 * p.bands.group_window)
        hits: dict[str, tuple] = {}
        for m, k, i in items:
            v = float(f.vals[i])
            if not (v > 0 and math.isfinite(v)):
                continue
            b = self.bands.get(k)
            if b is None:
                b = self.bands[k] = DriftBand()
            band = p.bands.logit_bands[m]
            if b.observe(s, f.t, math.log(v), BandSettings(band, p.bands.group_jump, p.bands.group_z,
                                                           p.bands.group_drift_k, windows, p.bands.drift_memory,
                                                           p.bands.group_confirm, p.alerts.hysteresis)) \
                    and b.sign > 0:
                size = (math.log(v) - b.anchor) / math.log(band)
                if m not in hits or size > hits[m][0]:
                    hits[m] = (size, k, v, math.exp(b.anchor), b)
        for m in p.bands.logit_bands:
            hit = hits.get(m)
            if hit is None:
                if ("logits", m) in f.open:
                    out.append(release("logits", m))
                continue
            _, k, v, ref, b = hit
            attn = "attn" in m
            how = (f"moved {math.exp(abs(b.stat)):.2f}x in one sample (>= group_jump = {p.bands.group_jump:g}x)"
                   if b.kind == "jump" else
                   f"moved {math.exp(abs(b.stat)):.2f}x in one sample (beyond its band "
                   f"logit_bands[{m!r}] = {p.bands.logit_bands[m]:g}x)" if b.kind == "step" else
                   f"rose {math.exp(abs(b.stat)):.2f}x over the last {b.window} steps, beyond "
                   f"group_drift_k = {p.bands.group_drift_k:g} x the rise it showed before and its band "
                   f"logit_bands[{m!r}] = {p.bands.logit_bands[m]:g}x")
            out.append(set_("logits", k, Level.YELLOW, Reading(v, ref, v / ref),
                            f"{k} = {v:.4g} is {v / ref:.2f}x the level it left ({ref:.4g}): it {how}.",
                            f"{k} started growing", key=m,
                            onset=None if f.active("logits", m) is not None else b.onset,
                            prescription="attn_logit_growth" if attn else "logit_drift",
                            details={"kind": b.kind}))
        return out

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        for b in self.bands.values():
            b.rewind(t_to)
        self.last_t = -(10 ** 9)
        return []


class RouterRule(RuleBase):
    """MoE router collapse: a router figure far above its own baseline.

    For each ``(metric, excess)`` of ``Policy.bands.router_bands`` (e.g.
    ``moe/maxvio.max``, ``moe/dead_expert_ratio``): baseline ``b`` = median
    over the baseline window, spread ``mad`` = 1.4826 x its median absolute
    deviation; out when ``x - b > max(router_z * mad, excess)`` at every check
    for ``router_steps`` steps -> YELLOW (METRICS.md §6 has no row: the
    prescription is the §2 router one). Released when back within the band.
    """

    name = "router"
    alert_ids = ("router",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("cols",)

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.cols: dict[str, list] = {}  # metric -> [samples, b, mad, first out step]

    def check(self, f: Figures) -> list[Change]:
        present = f.plan.cache.get(self.name)
        if present is None:
            present = f.plan.cache[self.name] = any(m in f.plan.named for m in self.p.bands.router_bands)
        if f.warm or not present:
            return []
        p, s, out = self.p, f.step, []
        end = f.start + p.baselines.steps
        for m, excess in p.bands.router_bands.items():
            v = f.get(m)
            if v is None or not math.isfinite(v):
                continue
            c = self.cols.get(m)
            if c is None:
                c = self.cols[m] = [[], _NAN, _NAN, None]
            if c[1] != c[1]:
                if f.t < end or len(c[0]) < p.baselines.min_samples:
                    c[0].append(v)
                if len(c[0]) >= p.baselines.min_samples and f.t >= end - 1:
                    b = median(c[0])
                    c[1], c[2] = b, 1.4826 * median([abs(z - b) for z in c[0]])
                    c[0] = []
                continue
            band = max(p.bands.router_z * c[2], excess)
            is_open = f.active("router", m) is not None
            if v - c[1] > (p.alerts.hysteresis * band if is_open else band):
                if c[3] is None:
                    c[3] = s
                if is_open or s - c[3] >= p.bands.router_steps:
                    out.append(set_("router", m, Level.YELLOW, Reading(v, c[1], v / c[1] if c[1] else _NAN),
                                    f"{m} = {v:.4g} has been above its baseline {c[1]:.4g} by more "
                                    f"than {band:.3g} since step {c[3]}: the router is collapsing "
                                    "onto a few experts.", f"{m} rose", onset=c[3],
                                    prescription="router_collapse"))
            else:
                c[3] = None
                out.append(release("router", m))
        return out

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        for c in self.cols.values():
            c[3] = None
        return []
