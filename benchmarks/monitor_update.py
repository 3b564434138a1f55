"""Cost of ``Monitor.update`` per call with ~300 realistic metrics.

30 global metrics + 9 per-layer families x 30 layers = 300 names, values as
the 0-d float32 NumPy arrays ``jax.device_get`` returns. The baseline phase
(first 1000 steps) runs first; the figure is the median over the following
calls, with every metric present at every call (the worst case: the spec's
cadence sends per-layer families only every 500 steps).

Run: ``python benchmarks/monitor_update.py [--calls N] [--layers L]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jvitals.monitor import Monitor

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
    "grad/Wk_abs.max", "grad/Wv_abs.max", "grad/Wo_abs.max",
]
FAMILIES = [
    "grad/norm", "grad/share", "param/norm", "act/hidden_states_rms", "act/hidden_states_abs.max",
    "grad/W_gate_rms", "grad/W_up_rms", "grad/W_down_rms", "act/attn_out_before_proj_rms",
]


def make_metrics(rng: np.random.Generator, step: int, layers: int) -> dict[str, np.ndarray]:
    d = {name: np.asarray(1.0 + 0.05 * rng.standard_normal(), np.float32) for name in GLOBAL}
    d["loss"] = np.asarray(2.0 + 3.0 * (1 + step / 200) ** -0.6, np.float32)
    d["grad/nonfinite_count"] = np.asarray(0, np.int32)
    d["opt/loss_scale"] = np.asarray(2.0 ** 15, np.float32)
    noise = 1.0 + 0.05 * rng.standard_normal((len(FAMILIES), layers))
    for f, fam in enumerate(FAMILIES):
        for i in range(layers):
            d[f"{fam}/layer_{i}"] = np.asarray(noise[f, i], np.float32)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    pool = [make_metrics(rng, s, args.layers) for s in range(64)]
    n = len(pool[0])
    monitor = Monitor()
    for s in range(args.warmup):
        d = dict(pool[s % 64])
        d["loss"] = np.asarray(2.0 + 3.0 * (1 + s / 200) ** -0.6, np.float32)
        monitor.update(s, d)
    times = []
    for s in range(args.warmup, args.warmup + args.calls):
        d = pool[s % 64]
        d["loss"] = np.asarray(2.0 + 3.0 * (1 + s / 200) ** -0.6, np.float32)
        t0 = time.perf_counter()
        monitor.update(s, d)
        times.append(time.perf_counter() - t0)
    # The expensive part runs only when an alert opens: ranking the per-layer history.
    t0 = time.perf_counter()
    for _ in range(20):
        monitor._layers.rank(args.warmup + args.calls, "the anomaly", "", monitor.policy)
    rank_ms = (time.perf_counter() - t0) / 20 * 1e3
    us = [t * 1e6 for t in times]
    levels = {a.level.name for a in monitor.history + monitor.alerts}
    print(f"Monitor.update with {n} metrics ({len(GLOBAL)} global + {len(FAMILIES)} families x "
          f"{args.layers} layers), {args.calls} calls after {args.warmup} baseline steps:")
    print(f"  median {statistics.median(us):.1f} us/call, p90 "
          f"{statistics.quantiles(us, n=10)[-1]:.1f} us, max {max(us):.0f} us "
          f"(alerts raised during the run: {sorted(levels) or 'none'})")
    print(f"  localization ranking when an alert opens ({monitor._layers.n} history rows x "
          f"{len(monitor._layers.names)} per-layer metrics): {rank_ms:.2f} ms")


if __name__ == "__main__":
    main()
