"""What the monitor can watch with the figures it is given, said once at the first check.

A loop that logs its figures under its own names (``train/loss``, ``grad_norm``) gives the
rules nothing to read: the monitor would stay GREEN through any fault. :func:`coverage`
reads the first check's names against what each default rule needs (:data:`INPUTS`) and
finds the names that look like a missing one (:data:`ALIASES`); :meth:`Coverage.summary`
says which rules are blind and the one-line name mapping that gives them their input
(``Monitor(names={"train/loss": "loss"})``). Quiet (an empty summary) when every core
figure is there.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, NamedTuple

__all__ = ["ALIASES", "CORE", "Coverage", "INPUTS", "coverage"]

INPUTS: Mapping[str, tuple[str, ...]] = {
    "nonfinite": ("loss", "grad/global_norm"),
    "early": ("loss", "grad/global_norm"),
    "data": ("loss",),
    "spike": ("loss",),
    "ratio": ("grad/global_norm",),
    "trend": ("grad/global_norm", "param/global_norm"),
    "jump": ("update/param_ratio",),
    "group": ("grad/share/", "update/param_ratio/", "param/norm/"),
    "logits": ("act/attn_logits_abs.max", "act/output_layer_logits_abs.max"),
    "attn_logits": ("act/attn_logits_abs.max",),
    "output_logits": ("act/output_layer_logits_abs.max",),
    "update_size": ("update/param_ratio",),
    "router": ("moe/",),
    "throughput": ("sys/tokens_per_sec", "sys/steps_per_sec"),
    "skip": ("window/skipped_steps",),
    "loss_scale": ("opt/loss_scale",),
    "val_gap": ("val/loss",),
    "val_rise": ("val/loss",),
    "broken_model": ("loss", "param/global_norm"),
    "replica": ("replica/",),
}
"""Per default rule, the figures it reads: it has its input when any is present (a name
ending in ``/`` stands for every figure under it)."""

CORE: tuple[str, ...] = ("loss", "grad/global_norm")
"""Figures without which the monitor is blind to most faults: their absence is said at the
first check, with the names that look like them."""

ALIASES: Mapping[str, str] = {
    r"(?:^|/)(?:train_?)?loss$|^loss/train$|^train/(?:lm_)?loss$|^(?:lm|training|total)_loss$|^train_loss$": "loss",
    r"grad(?:ient)?_?norm$|^grad/norm$|^(?:train/)?global_grad_norm$|^grad_norm/(?:total|global)$":
        "grad/global_norm",
    r"(?:^|/)(?:param(?:eter)?_?norm|weight_norm)$": "param/global_norm",
    r"(?:^|/)(?:lr|learning_rate)$": "opt/learning_rate",
    r"^(?:val|valid|validation|eval)[/_](?:lm_)?loss$|^loss/(?:val|eval)$": "val/loss",
    r"(?:^|/)(?:tokens_per_sec(?:ond)?|tok_per_sec|throughput)$": "sys/tokens_per_sec",
    r"(?:^|/)loss_scale$": "opt/loss_scale",
}
"""Names loops commonly log -> the name the rules read."""


class Coverage(NamedTuple):
    """What the monitor can watch: the rules with an input (``watched``), those left without
    one by a missing core figure (``blind``), the ``missing`` core figures, and ``suggest``:
    ``{name found: jvitals name}`` for each name that looks like a missing figure."""

    watched: tuple[str, ...]
    blind: tuple[str, ...]
    missing: tuple[str, ...]
    suggest: Mapping[str, str]

    def summary(self, step: int) -> str:
        """One short paragraph for the log ('' when every core figure is there)."""
        if not self.missing:
            return ""
        lines = [f"jvitals.Monitor: at step {step} the figures hold no {', '.join(repr(m) for m in self.missing)}: "
                 f"the rules {', '.join(self.blind)} have no input and stay GREEN whatever happens "
                 f"(watched: {', '.join(self.watched) or 'none'})."]
        if self.suggest:
            mapping = ", ".join(f"{k!r}: {v!r}" for k, v in self.suggest.items())
            lines.append(f"Your loop logs {', '.join(repr(k) for k in self.suggest)}: map them with "
                         f"vitals.Monitor(names={{{mapping}}}) (the names the rules read: docs/MONITOR.md).")
        else:
            lines.append("Log them under these names, or map yours with vitals.Monitor(names={'your name': "
                         "'loss', ...}) (docs/MONITOR.md); the recorder (vitals.record) gives grad/global_norm.")
        return " ".join(lines)


def _has(names: set[str], want: str) -> bool:
    if want.endswith("/"):
        return any(n.startswith(want) for n in names)
    return want in names


def coverage(names: Iterable[str], rules: Iterable[str]) -> Coverage:
    """What the rules named ``rules`` can watch given a check's figure ``names``."""
    have = set(names)
    watched, blind = [], []
    for r in rules:
        need = INPUTS.get(r)
        if need is None or r == "divergence":
            continue
        (watched if any(_has(have, w) for w in need) else blind).append(r)
    missing = tuple(m for m in CORE if m not in have)
    blind = [r for r in blind if any(w in missing for w in INPUTS[r])] if missing else []
    suggest: dict[str, str] = {}
    for n in sorted(have):
        for pattern, target in ALIASES.items():
            if target not in have and target not in suggest.values() and re.search(pattern, n, re.I) and n != target:
                suggest[n] = target
                break
    return Coverage(tuple(watched), tuple(blind), missing, suggest)
