"""Cost of the per-replica figures on the README's loop, side by side; and the stored healthy run.

Two variants of the README's light train step (its model, batch 8 x 32 tokens,
``with_lr_scale(record(chain(clip_by_global_norm(1.0), adamw(schedule))))``), on every
device of the default backend (8 forced CPU devices here) with the batch sharded
over a ``data`` axis (``NamedSharding``, the global view), in one process:

- **(a) README**: the step as the README writes it (``use_probes=True``; the probes'
  sows are unused on a light step, and XLA drops them), returning ``{"loss": loss}``.
- **(b) + replicas**: the same step computing the loss from its per-token values and
  returning ``vitals.replica_metrics(loss=per_token, mask=..., intermediates=...,
  replicas=R)`` beside it, every step: per-replica loss, tokens, non-finite count,
  hidden-state RMS / abs max and output-logit abs max. The model sows raw tensors
  (``use_probes=False``: the same computation; an unused raw sow costs nothing), which
  the replica figures read once each.

Each variant is compiled once (``jit(...).lower(...).compile()``, which also gives
XLA's ``memory_analysis()``), warmed up, then run interleaved: in each round both
variants run ``--block`` steps each, in a fresh random order, each step timed to
``block_until_ready``. Reported: the median ms per step of each and the median over
rounds of the per-round ratio (b) / (a) (paired: the noise of a shared machine hits
both sides of a round alike), and the compiled temporary / output bytes.

``--record N --out FILE`` instead trains (b) for ``N`` steps on a rotating data
layout -- 8 data shards (sources), replica ``r`` reading shard ``(r + step) % R``
at each step -- and stores every step's per-replica vectors (float32) and data
shards in a compressed ``.npz`` (what ``tests/test_replicas_healthy.py`` replays
through the rule).

Run: ``python benchmarks/replicas.py [--rounds 40] [--block 20]`` or
``python benchmarks/replicas.py --record 10000 --out tests/data/replicas/healthy_8dev.npz``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any, NamedTuple

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jvitals as vitals  # noqa: E402
from jvitals import reference_model as rm  # noqa: E402

BATCH, SEQ, NUM_STEPS = 8, 32, 600
FIGURES = ("loss", "tokens", "nonfinite", "hidden_states_rms", "hidden_states_abs.max",
           "output_layer_logits_abs.max")


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


def readme_cfg(probes: bool) -> rm.ModelConfig:
    return rm.ModelConfig(vocab=64, d_model=32, n_layers=2, use_probes=probes)


def readme_tx() -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=100, decay_steps=NUM_STEPS)
    return vitals.with_lr_scale(vitals.record(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), schedule=schedule))


def token_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token cross-entropy ``[B, T]`` (float32), what ``rm.cross_entropy`` averages."""
    x = logits.astype(jnp.float32)
    return jax.nn.logsumexp(x, axis=-1) - jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]


def make_step(replicas: int | None, tx: optax.GradientTransformation):
    """The README's light step; with ``replicas``, plus the per-replica figures."""
    model = rm.Decoder(readme_cfg(probes=replicas is None))

    def step(state: TrainState, batch: dict):
        def loss_fn(params):
            logits, sown = model.apply({"params": params}, batch["tokens"], mask=batch["mask"],
                                       mutable=["intermediates"])
            if replicas is None:
                return rm.cross_entropy(logits, batch["labels"], batch["mask"]), (None, sown)
            tok = token_loss(logits, batch["labels"])
            m = batch["mask"]
            loss = jnp.sum(jnp.where(m, tok, 0.0)) / jnp.maximum(jnp.sum(m), 1)
            return loss, (tok, sown)

        (loss, (tok, sown)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params, vitals_layers=False)
        metrics = {"loss": loss}
        if replicas is not None:
            metrics |= vitals.replica_metrics(loss=tok, mask=batch["mask"], intermediates=sown,
                                              replicas=replicas)
        new = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
        return new, metrics

    return step


def shard_batches(mesh: jax.sharding.Mesh, rotate: bool):
    """``batch(step)``: the global batch, replica ``r``'s rows from data shard ``(r + step) % R``
    (``rotate``) or ``r``; returns ``(batch on the mesh, data shards [R])``."""
    cfg = readme_cfg(True)
    r_count = mesh.shape["data"]
    per = BATCH // r_count
    sharding = NamedSharding(mesh, P("data"))

    def batch(step: int) -> tuple[dict, np.ndarray]:
        shards = (np.arange(r_count) + (step if rotate else 0)) % r_count
        parts = [rm.make_batch(int(shard) * 1_000_003 + step, cfg, batch=per, seq=SEQ) for shard in shards]
        host = {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}
        return {k: jax.device_put(v, sharding) for k, v in host.items()}, shards

    return batch


def setup(mesh: jax.sharding.Mesh):
    tx = readme_tx()
    params = rm.init_params(readme_cfg(True), jax.random.key(0))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))
    return tx, state


def measure(args: argparse.Namespace) -> int:
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    r_count = mesh.shape["data"]
    tx, state0 = setup(mesh)
    batch_of = shard_batches(mesh, rotate=True)
    batches = [batch_of(i)[0] for i in range(args.block)]
    variants = {}
    for name, reps in (("(a) README", None), ("(b) + replicas", r_count)):
        fn = jax.jit(make_step(reps, tx), donate_argnums=0)
        compiled = fn.lower(state0, batches[0]).compile()
        mem = compiled.memory_analysis()
        variants[name] = {"fn": compiled, "state": jax.tree.map(jnp.copy, state0), "times": [],
                          "temp": int(getattr(mem, "temp_size_in_bytes", 0)),
                          "out": int(getattr(mem, "output_size_in_bytes", 0))}
    for v in variants.values():          # warm up
        for b in batches[:3]:
            v["state"], m = v["fn"](v["state"], b)
        jax.block_until_ready(m)
    ratios = []
    rng = random.Random(0)
    for _ in range(args.rounds):
        names = list(variants)
        rng.shuffle(names)
        med = {}
        for name in names:
            v = variants[name]
            times = []
            for b in batches:
                t0 = time.perf_counter()
                v["state"], m = v["fn"](v["state"], b)
                jax.block_until_ready((v["state"], m))
                times.append(time.perf_counter() - t0)
            v["times"] += times
            med[name] = statistics.median(times)
        ratios.append(med["(b) + replicas"] / med["(a) README"])
    base = variants["(a) README"]
    print(f"# devices: {jax.device_count()} x {jax.devices()[0].platform}; replicas R = {r_count}; "
          f"{args.rounds} rounds x {args.block} steps each, interleaved")
    for name, v in variants.items():
        print(f"#   {name:<16} median {1e3 * statistics.median(v['times']):7.3f} ms/step   "
              f"temp {v['temp'] / 2**20:8.4f} MiB ({v['temp'] - base['temp']:+d} B)   "
              f"out {v['out']} B ({v['out'] - base['out']:+d} B)")
    q = np.quantile(ratios, [0.25, 0.5, 0.75])
    print(f"# step-time ratio (b) / (a): median of per-round ratios {q[1]:.4f} "
          f"(quartiles {q[0]:.4f} .. {q[2]:.4f}); overhead {100 * (q[1] - 1):+.2f}%")
    return 0


def record(args: argparse.Namespace) -> int:
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    r_count = mesh.shape["data"]
    tx, state = setup(mesh)
    batch_of = shard_batches(mesh, rotate=True)
    step = jax.jit(make_step(r_count, tx), donate_argnums=0)
    n = args.record
    out = {f: np.zeros((n, r_count), np.float32) for f in FIGURES}
    data = np.zeros((n, r_count), np.int8)
    loss = np.zeros(n, np.float32)
    t0 = time.perf_counter()
    for i in range(n):
        b, shards = batch_of(i)
        state, m = step(state, b)
        m = jax.device_get(m)
        for f in FIGURES:
            out[f][i] = m["replica/" + f]
        data[i], loss[i] = shards, m["loss"]
        if i % 1000 == 0:
            print(f"step {i}: loss {loss[i]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    np.savez_compressed(args.out, data=data, loss=loss, **{f.replace(".", "_"): v for f, v in out.items()})
    print(f"wrote {args.out}: {n} steps x {r_count} replicas, {os.path.getsize(args.out) / 2**20:.2f} MiB, "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds")
    ap.add_argument("--block", type=int, default=20, help="steps per variant per round")
    ap.add_argument("--record", type=int, default=0, help="record a healthy run of this many steps")
    ap.add_argument("--out", default="tests/data/replicas/healthy_8dev.npz")
    args = ap.parse_args(argv)
    return record(args) if args.record else measure(args)


if __name__ == "__main__":
    sys.exit(main())
