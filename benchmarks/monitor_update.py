"""Cost of ``Monitor.update`` per call in a realistic loop, ~300 metrics.

The figures as the recorder returns them after ``jax.device_get`` (0-d
float32/int32 NumPy arrays): 31 global figures every call (with
``opt/learning_rate`` on a warm-up + cosine schedule); every
``--layers-every`` steps (50, as the recorder's ``vitals_heavy`` step) also
9 per-layer families x 30 layers and the group figures of ``embedding`` and
``lm_head`` (``grad/norm``, ``grad/share``, ``param/norm``,
``update/param_ratio``, and ``update/param_ratio/layer_i``): 31 + 270 + 38 =
339 names on those calls. The baseline phase (first 1000 steps) runs first;
the figures are the median over all following calls (the README's number)
and over the light and the heavy calls apart.

Run: ``python benchmarks/monitor_update.py [--calls N] [--layers L] [--layers-every K]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jvitals.monitor.localize import localize
from jvitals.monitor.monitor import Monitor

GLOBAL = [
    "loss", "ppl", "grad/global_norm", "grad/global_norm_post_clip", "grad/clip_ratio",
    "grad/nonfinite_count", "param/global_norm", "update/global_norm", "update/param_ratio",
    "opt/adam_nu_abs.max", "opt/adam_nu_log10_spread", "opt/loss_scale", "opt/skipped_steps",
    "sys/steps_per_sec", "sys/tokens_per_sec", "sys/device_memory_bytes",
    "sys/device_memory_peak_bytes", "act/output_layer_logits_rms.avg",
    "act/output_layer_logits_abs.max", "act/output_layer_logits_top2_diff.avg",
    "act/output_layer_logits_top2_equal_ratio", "act/hidden_states_abs.max",
    "act/hidden_states_rms.avg", "act/attn_out_before_proj_rms.avg",
    "grad/word_embeddings_abs.max", "grad/output_layer_abs.max", "grad/Wq_abs.max",
    "grad/Wk_abs.max", "grad/Wv_abs.max", "grad/Wo_abs.max", "opt/learning_rate",
]
FAMILIES = [
    "grad/norm", "grad/share", "param/norm", "act/hidden_states_rms", "act/hidden_states_abs.max",
    "grad/W_gate_rms", "grad/W_up_rms", "grad/W_down_rms", "act/attn_out_before_proj_rms",
]


GROUP_FAMILIES = ["grad/norm", "grad/share", "param/norm", "update/param_ratio"]


def lr_at(step: int) -> float:
    """Warm-up (200 steps) then cosine decay over 20,000 steps."""
    if step < 200:
        return 3e-3 * step / 200
    return 3e-4 + 2.7e-3 * 0.5 * (1 + np.cos(np.pi * min(step - 200, 20_000) / 20_000))


def make_metrics(rng: np.random.Generator, step: int, layers: int,
                 heavy: bool) -> dict[str, np.ndarray]:
    d = {name: np.asarray(1.0 + 0.05 * rng.standard_normal(), np.float32) for name in GLOBAL}
    d["loss"] = np.asarray(2.0 + 3.0 * (1 + step / 200) ** -0.6, np.float32)
    d["grad/nonfinite_count"] = np.asarray(0, np.int32)
    d["opt/loss_scale"] = np.asarray(2.0 ** 15, np.float32)
    d["param/global_norm"] = np.asarray(100.0 * (1 + 0.001 * rng.standard_normal()), np.float32)
    d["opt/learning_rate"] = np.asarray(lr_at(step), np.float32)
    if heavy:
        noise = 1.0 + 0.05 * rng.standard_normal((len(FAMILIES) + 1, layers))
        for f, fam in enumerate(FAMILIES + ["update/param_ratio"]):
            for i in range(layers):
                d[f"{fam}/layer_{i}"] = np.asarray(noise[f, i] / (layers if fam == "grad/share" else 1),
                                                   np.float32)
        for g in ("embedding", "lm_head"):
            for fam in GROUP_FAMILIES:
                d[f"{fam}/{g}"] = np.asarray((1.0 + 0.05 * rng.standard_normal())
                                             / (layers if fam == "grad/share" else 1), np.float32)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--layers-every", type=int, default=50)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    every = args.layers_every
    light_pool = [make_metrics(rng, s, args.layers, False) for s in range(64)]
    heavy_pool = [make_metrics(rng, s, args.layers, True) for s in range(16)]

    def metrics(s: int) -> tuple[dict[str, np.ndarray], bool]:
        heavy = s % every == 0
        pool = heavy_pool if heavy else light_pool
        d = dict(pool[(s // every if heavy else s) % len(pool)])
        d["loss"] = np.asarray(2.0 + 3.0 * (1 + s / 200) ** -0.6, np.float32)
        d["opt/learning_rate"] = np.asarray(lr_at(s), np.float32)
        return d, heavy

    monitor = Monitor()
    for s in range(args.warmup):
        monitor.update(s, metrics(s)[0])
    times, heavy_t, light_t = [], [], []
    for s in range(args.warmup, args.warmup + args.calls):
        d, heavy = metrics(s)
        t0 = time.perf_counter()
        monitor.update(s, d)
        dt = (time.perf_counter() - t0) * 1e6
        times.append(dt)
        (heavy_t if heavy else light_t).append(dt)
    # The expensive part runs only when an alert opens: localization over the history.
    t0 = time.perf_counter()
    for _ in range(5):
        localize(monitor._layers, args.warmup + args.calls - 100, "the anomaly", monitor.policy)
    loc_ms = (time.perf_counter() - t0) / 5 * 1e3
    levels = {a.level.name for a in monitor.history + monitor.alerts}
    n_light = len(light_pool[0])
    n_heavy = len(heavy_pool[0])
    print(f"Monitor.update, {n_light} figures every call and {n_heavy} every {every} steps "
          f"({len(GLOBAL)} global + {len(FAMILIES) + 1} per-layer families x {args.layers} layers "
          f"+ group figures), {args.calls} calls after {args.warmup} (baselines from step "
          f"{monitor.baseline_start}: {monitor.baseline_start_reason}):")
    print(f"  median {statistics.median(times):.1f} us/call, p90 "
          f"{statistics.quantiles(times, n=10)[-1]:.1f} us, max {max(times):.0f} us; "
          f"light calls median {statistics.median(light_t):.1f} us, heavy calls median "
          f"{statistics.median(heavy_t):.1f} us (alerts raised: {sorted(levels) or 'none'})")
    print(f"  localization when an alert opens ({monitor._layers.n} history rows x "
          f"{len(monitor._layers.names)} candidates): {loc_ms:.2f} ms")


if __name__ == "__main__":
    main()
