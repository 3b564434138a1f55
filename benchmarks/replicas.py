"""Cost of the per-replica figures on the README's loop, side by side; and the stored healthy run.

Variants of the README's light train step (its model, batch 8 x 32 tokens,
``with_lr_scale(record(chain(clip_by_global_norm(1.0), adamw(schedule))))``), with the
batch sharded over a ``data`` axis of ``--devices`` devices (``NamedSharding``, the
global view; 1 device: the README's loop as it runs), R = 8 replicas, in one process:

- **(a) README**: the step as the README writes it (``use_probes=True``; the probes'
  sows are unused on a light step, and XLA drops them), returning ``{"loss": loss}``.
  **(a')** is the same step compiled again: its ratio to (a) shows the noise floor.
- **(b) + replica loss**: the same step computing the loss from its per-token values
  and returning ``vitals.replica_metrics(loss=per_token, mask=..., replicas=R)`` every
  step: per-replica loss, tokens, non-finite count.
- **(c) + replica loss, activations**: (b) plus ``intermediates=``: per-replica
  hidden-state RMS / abs max and output-logit abs max. The model sows raw tensors
  (``use_probes=False``: the same computation; an unused raw sow costs nothing), which
  the replica figures read once each.

Each variant is compiled once (``jit(...).lower(...).compile()``, which also gives
XLA's ``memory_analysis()``), warmed up, then run interleaved: in each round every
variant runs ``--block`` steps, in a fresh random order, each step timed to
``block_until_ready`` by the wall clock and by the process's CPU time (less sensitive
to other processes on a shared machine). Reported: the median ms per step and the
median over rounds of the per-round ratio to (a) (paired: the noise of a shared
machine hits both sides of a round alike), with quartiles, and the compiled temporary
/ output bytes against (a).

``--record N --out FILE`` instead trains (c) for ``N`` steps on a rotating data
layout -- 8 data shards (sources), replica ``r`` reading shard ``(r + step) % R``
at each step -- and stores every step's per-replica vectors (float32) and data
shards in a compressed ``.npz`` (what ``tests/test_replicas_healthy.py`` replays
through the rule).

Run: ``python benchmarks/replicas.py [--devices 1] [--rounds 60] [--block 10]`` or
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


VARIANTS = {
    "(a) README": dict(replicas=False, activations=False),
    "(a') README again": dict(replicas=False, activations=False),
    "(b) + replica loss": dict(replicas=True, activations=False),
    "(c) + replica loss, activations": dict(replicas=True, activations=True),
}
"""(a') is (a) compiled again: its ratio to (a) is the noise floor of the measurement."""


def make_step(r_count: int, tx: optax.GradientTransformation, replicas: bool, activations: bool):
    """The README's light step; with ``replicas``, plus the per-replica figures (loss, tokens,
    non-finite count; with ``activations`` also hidden-state RMS / abs max, logit abs max)."""
    model = rm.Decoder(readme_cfg(probes=not activations))

    def step(state: TrainState, batch: dict):
        def loss_fn(params):
            logits, sown = model.apply({"params": params}, batch["tokens"], mask=batch["mask"],
                                       mutable=["intermediates"])
            if not replicas:
                return rm.cross_entropy(logits, batch["labels"], batch["mask"]), {}
            tok = token_loss(logits, batch["labels"])
            m = batch["mask"]
            loss = jnp.sum(jnp.where(m, tok, 0.0)) / jnp.maximum(jnp.sum(m), 1)
            # Inside the loss function: the forward reduces the sown values to (R,) vectors,
            # so no [B, T, V] logits stay alive through the backward pass.
            return loss, vitals.replica_metrics(loss=tok, mask=m, intermediates=sown if activations else None,
                                                replicas=r_count)

        (loss, rep), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params, vitals_heavy=False)
        metrics = {"loss": loss} | rep
        new = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
        return new, metrics

    return step


def shard_batches(mesh: jax.sharding.Mesh, rotate: bool, replicas: int = 8):
    """``batch(step)``: the global batch, replica ``r``'s rows from data shard ``(r + step) % R``
    (``rotate``) or ``r``; returns ``(batch on the mesh, data shards [R])``."""
    cfg = readme_cfg(True)
    r_count = replicas
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


def make_mesh(devices: int) -> jax.sharding.Mesh:
    devs = np.array(jax.devices()[:devices or jax.device_count()])
    return jax.sharding.Mesh(devs, ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def measure(args: argparse.Namespace) -> int:
    mesh = make_mesh(args.devices)
    tx, state0 = setup(mesh)
    batch_of = shard_batches(mesh, rotate=True, replicas=args.replicas)
    batches = [batch_of(i)[0] for i in range(args.block)]
    variants = {}
    for name, kw in VARIANTS.items():
        fn = jax.jit(make_step(args.replicas, tx, **kw), donate_argnums=0)
        compiled = fn.lower(state0, batches[0]).compile()
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
        variants[name] = {"fn": compiled, "state": jax.tree.map(jnp.copy, state0), "wall": [], "cpu": [],
                          "temp": int(getattr(mem, "temp_size_in_bytes", 0)),
                          "out": int(getattr(mem, "output_size_in_bytes", 0)),
                          "flops": float(cost.get("flops", 0.0)),
                          "bytes": float(cost.get("bytes accessed", 0.0))}
    for v in variants.values():          # warm up
        for b in batches[:3]:
            v["state"], m = v["fn"](v["state"], b)
        jax.block_until_ready(m)
    ratios: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in variants}
    rng = random.Random(0)
    base = "(a) README"
    for _ in range(args.rounds):
        names = list(variants)
        rng.shuffle(names)
        med = {}
        for name in names:
            v = variants[name]
            wall, cpu = [], []
            for b in batches:
                t0, c0 = time.perf_counter(), time.process_time()
                v["state"], m = v["fn"](v["state"], b)
                jax.block_until_ready((v["state"], m))
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            v["wall"] += wall
            v["cpu"] += cpu
            med[name] = {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}
        for name in variants:
            for k in ("wall", "cpu"):
                ratios[name][k].append(med[name][k] / med[base][k])
    b0 = variants[base]
    print(f"# {jax.device_count()} x {jax.devices()[0].platform} device(s) available; mesh of "
          f"{mesh.size}; replicas R = {args.replicas}; {args.rounds} rounds x {args.block} steps per "
          f"variant, interleaved in a random order each round")
    low = {n: float(np.quantile(v["wall"], 0.05)) for n, v in variants.items()}
    for name, v in variants.items():
        qw = np.quantile(ratios[name]["wall"], [0.25, 0.5, 0.75])
        qc = np.quantile(ratios[name]["cpu"], [0.25, 0.5, 0.75])
        print(f"#   {name:<34} wall {1e3 * statistics.median(v['wall']):7.3f} ms  ratio {qw[1]:.4f} "
              f"({qw[0]:.3f}..{qw[2]:.3f})  p5 ratio {low[name] / low[base]:.4f}   process CPU "
              f"{1e3 * statistics.median(v['cpu']):7.3f} ms  ratio {qc[1]:.4f} ({qc[0]:.3f}..{qc[2]:.3f})   "
              f"XLA flops x{v['flops'] / max(b0['flops'], 1):.4f} bytes x{v['bytes'] / max(b0['bytes'], 1):.4f}"
              f"   temp {v['temp'] - b0['temp']:+d} B   out {v['out'] - b0['out']:+d} B")
    print("# ratio: median over rounds of (variant's median step) / ((a)'s median step), quartiles in "
          "brackets; p5 ratio: 5th percentile of all its steps over (a)'s (the least disturbed steps); "
          "XLA flops/bytes: compiled cost_analysis(); temp/out: memory_analysis() bytes against (a)")
    return 0


def record(args: argparse.Namespace) -> int:
    mesh = make_mesh(args.devices)
    r_count = args.replicas
    tx, state = setup(mesh)
    batch_of = shard_batches(mesh, rotate=True, replicas=r_count)
    step = jax.jit(make_step(r_count, tx, replicas=True, activations=True), donate_argnums=0)
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
    np.savez_compressed(args.out, data=data, global_loss=loss,
                        **{"replica/" + f: v for f, v in out.items()})
    print(f"wrote {args.out}: {n} steps x {r_count} replicas, {os.path.getsize(args.out) / 2**20:.2f} MiB, "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60, help="interleaved rounds")
    ap.add_argument("--block", type=int, default=10, help="steps per variant per round")
    ap.add_argument("--record", type=int, default=0, help="record a healthy run of this many steps")
    ap.add_argument("--out", default="tests/data/replicas/healthy_8dev.npz")
    ap.add_argument("--devices", type=int, default=0, help="devices of the mesh (0: all)")
    ap.add_argument("--replicas", type=int, default=8, help="replicas R (a divisor of the batch, 8)")
    args = ap.parse_args(argv)
    return record(args) if args.record else measure(args)


if __name__ == "__main__":
    sys.exit(main())
