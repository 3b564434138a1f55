"""Forms of the recorder's light step, side by side: which way of taking its norms is cheapest.

The light step (``record(chain(clip, adamw))`` with ``vitals_heavy=False``, every
step) measures the global norms of the gradients, the parameters and the updates.
This compiles the reference model's step once without vitals and once per form of
:func:`jvitals.metrics.light.light_metrics` (swapped in while tracing), and prints
each form's extra bytes (XLA's cost analysis, the non-finite branch taken out, in
units of the parameters' bytes P), temporary memory and paired time, all in one
process (``benchmarks/overhead.py`` measures the shipped form on every config):

- ``fold``: one variadic reduction per leaf over gradient, parameter and update (the
  form before the light step took the clip's norm);
- ``plain``: the gradient norm as optax writes it (the clip's, computed once),
  plain sums for parameters and updates;
- ``pu_fold``: the clip's gradient norm, parameters and updates in one variadic
  reduction per leaf;
- ``shipped``: what the recorder's light step does under ``jit``
  (:func:`jvitals.metrics.light.light_metrics`): the clip's gradient norm, the
  parameters' plain sum, the updates' variadic reduction per leaf, every group's figures
  from those sums;
- ``no_update``: the clip's gradient norm and the parameters' plain sum only (the
  floor without update figures; not a valid recorder: it reports ``||g||`` as the
  update norm).

Run: ``python benchmarks/light_forms.py [--config d256] [--tokens 256] [--min-seconds 60]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as ob  # noqa: E402  (the benchmark's model, steps and timing)

from jvitals.metrics import gradients as G  # noqa: E402
from jvitals.metrics.clip_norm import norm_and_count, norm_as_optax  # noqa: E402
from jvitals.metrics import light as L  # noqa: E402

Norms = Callable[..., dict[str, jax.Array]]


def _fold(trees: dict[str, Any]) -> dict[str, Any]:
    return G.tree_stats(trees, what="grads")


def _clip_grad(grads: Any) -> dict[str, jax.Array]:
    g, count = norm_and_count(grads)
    return {"grad/global_norm": g, "grad/nonfinite_count": count}


def fold(grads: Any, params: Any = None, updates: Any = None, **_: Any) -> dict[str, jax.Array]:
    t = _fold({"grads": grads, "params": params, "updates": updates})
    out = {"grad/global_norm": t["grads"].all.norm, "grad/nonfinite_count": G.nonfinite_count(t["grads"].all),
           "param/global_norm": t["params"].all.norm}
    if updates is not None:
        out["update/global_norm"] = t["updates"].all.norm
    return out


def pu_fold(grads: Any, params: Any = None, updates: Any = None, **_: Any) -> dict[str, jax.Array]:
    t = _fold({"params": params, "updates": updates})
    out = {**_clip_grad(grads), "param/global_norm": t["params"].all.norm}
    if updates is not None:
        out["update/global_norm"] = t["updates"].all.norm
    return out


def plain(grads: Any, params: Any = None, updates: Any = None, **_: Any) -> dict[str, jax.Array]:
    out = {**_clip_grad(grads), "param/global_norm": norm_as_optax(params)[0]}
    if updates is not None:
        out["update/global_norm"] = norm_as_optax(updates)[0]
    return out


def no_update(grads: Any, params: Any = None, updates: Any = None, **_: Any) -> dict[str, jax.Array]:
    out = {**_clip_grad(grads), "param/global_norm": norm_as_optax(params)[0]}
    if updates is not None:
        out["update/global_norm"] = out["grad/global_norm"]
    return out


FORMS: dict[str, Norms] = {"fold": fold, "plain": plain, "pu_fold": pu_fold, "shipped": L.light_metrics,
                           "no_update": no_update}


def build(size: ob.Size, batch_shape: tuple[int, int], forms: list[str]) -> tuple[list[ob.Variant], int]:
    """The step without vitals and one light step per form, compiled; the parameters' bytes.
    The forms other than ``shipped`` give the global figures only (no group's)."""
    params, batches = ob.inputs(size.cfg, batch_shape)
    shipped = L.light_metrics
    out = []
    try:
        for name in ["none"] + forms:
            L.light_metrics = FORMS.get(name, shipped)  # read while the step is traced
            step, tx = ob.variants(size.cfg, "chain", ["light"])["none" if name == "none" else "light"]
            out.append(ob.compile_variant(name, step, tx, params, batches))
    finally:
        L.light_metrics = shipped
    return out, ob._nbytes(params)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="d256")
    ap.add_argument("--tokens", type=int, default=256, help="256 = 4 x 64, 1024 = 8 x 128")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--min-seconds", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    size = ob.sizes()[a.config]
    vs, p_bytes = build(size, (4, 64) if a.tokens == 256 else (8, a.tokens // 8), a.forms.split(","))
    n = ob.measure(vs, a.rounds, a.min_seconds, 400)
    base = vs[0]
    print(f"{size.describe()}, {a.tokens} tokens: step without vitals {statistics.median(base.times) * 1e3:.1f} ms, "
          f"{n} paired rounds, load {ob.load()}; P = {p_bytes / ob.MB:.2f} MB\n")
    print("| light step form | extra bytes (P) | temp x | time x |\n|---|---:|---:|---:|")
    for v in vs[1:]:
        print(f"| {v.name} | {(v.healthy - base.healthy) / p_bytes:.2f} | {v.temp / max(base.temp, 1):.3f} | "
              f"{ob.paired(v, base):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
