"""The guard's remedy against the global LR cut, on an embedding-LR fault (issue 19, Deliver 6).

A tiny dense reference model (:mod:`jvitals.reference_model`) trains with Adam
wrapped in ``vitals.with_lr_scale(..., groups="roles")``; from ``fault_step`` on,
the loop multiplies the embedding's final updates by ``mult`` (a per-group LR
mismatch that lives in the loop, so no restore undoes it). A real
:class:`jvitals.Monitor` watches the loss, the global norms and the group figures
(``grad/share/{g}``, ``update/param_ratio/{g}``, ``param/norm/{g}`` of the applied
updates, every step); a real :class:`jvitals.Rollback` on orbax checkpoints acts
on its verdicts. Two arms, the same seed and fault:

- ``global``: ``Rollback(recovery=Recovery(lr_factor=0.9))`` (today: the global LR x0.9 per rollback);
- ``remedy``: ``Rollback(recovery=Recovery(lr_factor=0.9, remedies="default"))`` (plus the alert's
  group LR x0.5: the embedding's).

Measured per arm: the first group alert naming the embedding, the first red, the
rollbacks, the relapses (a red after a rollback), the final embedding/global LR
scales, the loss before the fault and at the end.

Usage::

    python benchmarks/remedies.py --seeds 0 1 2 3 --mult 100 --steps 600   # the table in docs/REMEDIES.md
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jvitals as vitals
from jvitals import reference_model as rm
from jvitals.monitor import BaselineConfig, Monitor, Policy
from jvitals.guard import Action, Retention, Rollback, Recovery, RollbackLimitError

CFG = rm.ModelConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                     sow_attn_logits=False)
LR = 3e-3
BATCH, SEQ = 8, 16
TX = vitals.with_lr_scale(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR)), groups="roles")


def policy() -> Policy:
    """The monitor's policy for a few-hundred-step run (baselines from step 20 for 60 steps)."""
    return Policy(baselines=BaselineConfig(warmup_steps=20, steps=60))


def _group_of(path: str) -> str:
    head = path.split("/")[0]
    if head == "embed":
        return "embedding"
    if head == "lm_head":
        return "lm_head"
    if head.startswith("layers_"):
        return f"layer_{int(head.split('_')[1])}"
    return "other"


def _sq_by_group(tree: Any) -> tuple[dict[str, jax.Array], jax.Array]:
    out: dict[str, jax.Array] = {}
    total = jnp.zeros((), jnp.float32)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        g = _group_of(jax.tree_util.keystr(path, simple=True, separator="/"))
        s = jnp.sum(jnp.square(jnp.asarray(x, jnp.float32)))
        out[g] = out.get(g, 0.0) + s
        total = total + s
    return out, total


def group_figures(grads: Any, params: Any, updates: Any) -> dict[str, jax.Array]:
    """``grad/share/g``, ``param/norm/g`` and ``update/param_ratio/g`` of the applied updates.

    ``grad/share/g = ||g_g||^2 / ||g||^2``, ``update/param_ratio/g = ||u_g|| / ||p_g||``
    (METRICS.md §2), for ``g`` in ``embedding``, ``lm_head``, ``layer_i``.
    """
    g, gt = _sq_by_group(grads)
    p, _ = _sq_by_group(params)
    u, _ = _sq_by_group(updates)
    out = {}
    for k in g:
        if k == "other":
            continue
        out[f"grad/share/{k}"] = g[k] / gt
        out[f"param/norm/{k}"] = jnp.sqrt(p[k])
        out[f"update/param_ratio/{k}"] = jnp.sqrt(u[k]) / jnp.sqrt(p[k])
    return out


@jax.jit
def train_step(params: Any, opt_state: Any, batch: Mapping[str, jax.Array], emb_mult: jax.Array):
    """One Adam step; the embedding's final updates x ``emb_mult`` (the fault)."""
    loss, grads = jax.value_and_grad(lambda p: rm.loss_fn(p, batch, CFG)[0])(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    updates = dict(updates, embed=jax.tree.map(lambda u: u * emb_mult, updates["embed"]))
    metrics = {"loss": loss, "grad/global_norm": optax.tree.norm(grads),
               "param/global_norm": optax.tree.norm(params),
               **group_figures(grads, params, updates)}
    return optax.apply_updates(params, updates), opt_state, metrics


_BATCHES: dict[tuple[int, int], Any] = {}


def batch_at(seed: int, position: int) -> Any:
    key = (seed, position)
    if key not in _BATCHES:
        _BATCHES[key] = rm.make_batch(1_000_003 * seed + position, CFG, BATCH, SEQ)
    return _BATCHES[key]


def run_arm(directory: str | Path, *, remedies: Any, mult: float, steps: int = 400,
            fault_step: int = 150, seed: int = 0, save_every: int = 10, max_rollbacks: int = 4,
            ) -> dict[str, Any]:
    """Trains one arm; returns what happened (see the module doc)."""
    params = rm.init_params(CFG, jax.random.key(seed))
    state = {"params": params, "opt_state": TX.init(params), "step": jnp.asarray(0, jnp.int32)}
    monitor = Monitor(policy())
    guard = Rollback(directory, save_every=save_every, retention=Retention(keep_last=3, keep_every=None),
                     recovery=Recovery(max_rollbacks=max_rollbacks, lr_factor=0.9, remedies=remedies))
    state, position = guard.resume(state, 0, monitor)
    losses: dict[int, float] = {}
    out: dict[str, Any] = {"group_alert_step": None, "first_red": None, "rollbacks": [],
                           "limit": None, "responses": []}
    t0 = time.perf_counter()
    for step in range(steps):
        m = jnp.float32(mult if step >= fault_step else 1.0)
        p, o, metrics = train_step(state["params"], state["opt_state"], batch_at(seed, position), m)
        state = {"params": p, "opt_state": o, "step": state["step"] + 1}
        position += 1
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        losses[step] = host["loss"]
        verdict = monitor.update(step, host)
        if out["group_alert_step"] is None and any(
                a.rule == "group" and (a.details or {}).get("group") == "embedding" for a in verdict.alerts):
            out["group_alert_step"] = step
        try:
            r = guard.act(step, state, verdict, position)
        except RollbackLimitError as e:
            out["limit"] = step
            out["limit_error"] = str(e)
            break
        state, position = r.state, r.position
        if r.action is Action.ROLLBACK:
            if out["first_red"] is None:
                out["first_red"] = step
            out["rollbacks"].append({"step": step, "to_step": r.target_step,
                                     "recovery": guard.history[-1]["recovery"]})
            out["responses"].append(r)
    guard.wait()
    out["guard"] = guard
    out["state"] = state
    out["losses"] = losses
    out["wall_s"] = time.perf_counter() - t0
    out["relapses"] = max(0, len(out["rollbacks"]) - 1) + (1 if out["limit"] is not None else 0)
    out["open_at_end"] = [f"{a.level.name} {a.rule}:{a.metric}" for a in verdict.alerts]
    out["emb_scale"] = vitals.get_lr_scale(state["opt_state"], "embedding")
    out["global_scale"] = vitals.get_lr_scale(state["opt_state"])
    pre = [losses[s] for s in range(max(0, fault_step - 20), fault_step)]
    out["loss_pre"] = float(np.mean(pre))
    last = sorted(losses)[-20:]
    out["loss_end"] = float(np.mean([losses[s] for s in last]))
    out["recovered"] = (out["limit"] is None and math.isfinite(out["loss_end"])
                        and out["loss_end"] < 1.2 * out["loss_pre"])
    return out


def summary_row(arm: str, seed: int, mult: float, r: Mapping[str, Any]) -> str:
    reds = [x["step"] for x in r["rollbacks"]]
    return (f"| {arm} | {seed} | x{mult:g} | {r['group_alert_step']} | {r['first_red']} | "
            f"{len(reds)} ({', '.join(map(str, reds)) or '-'}) | {r['relapses']} | "
            f"{'yes at ' + str(r['limit']) if r['limit'] is not None else 'no'} | "
            f"{r['emb_scale']:.3g} / {r['global_scale']:.3g} | {r['loss_pre']:.3f} -> {r['loss_end']:.3f} | "
            f"{'yes' if r['recovered'] else 'no'} |")


HEADER = ("| arm | seed | fault | group alert (step) | first red | rollbacks (steps) | relapses | "
          "limit hit | LR scale emb / global | loss pre-fault -> end | recovered |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--mult", type=float, nargs="+", default=[30.0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--fault-step", type=int, default=150)
    args = ap.parse_args(argv)
    print(HEADER)
    for mult in args.mult:
        for seed in args.seeds:
            for arm, rem in (("global x0.9", None), ("remedy (default)", "default")):
                with tempfile.TemporaryDirectory() as d:
                    r = run_arm(d, remedies=rem, mult=mult, steps=args.steps,
                                fault_step=args.fault_step, seed=seed)
                    r["guard"].close()
                print(summary_row(arm, seed, mult, r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
