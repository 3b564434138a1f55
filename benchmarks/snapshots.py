"""Cost of the light recent snapshots (``Rollback(saving=Saving(snapshots=Snapshots(...)))``), measured side by side.

One process trains the reference model with the guard in the loop, in alternating
blocks of steps: (a) the guard with its cadence checkpoints only, (b) the same plus
snapshots every ``--snap-every`` steps (keep ``--keep``). Each block starts from
the same state; the per-step wall time of each variant is the median over its
blocks, so the machine's drift hits both alike. Printed:

- per-step time (b) / (a): what the snapshots cost on every step, amortised
  (the asynchronous save's blocking part plus the copy to host);
- the snapshot directory's disk use, in bytes and as a ratio to one cadence
  checkpoint and to the train state's bytes in memory.

Usage::

    python benchmarks/snapshots.py                    # CPU, ~1-3 minutes
    python benchmarks/snapshots.py --d-model 512 --layers 4 --steps 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jvitals import reference_model as rm
from jvitals.optim.lr_scale import with_lr_scale
from jvitals.guard.rollback import Retention, Rollback, Saving, Snapshots


class State(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100, help="steps per block")
    ap.add_argument("--blocks", type=int, default=3, help="blocks per variant (alternating)")
    ap.add_argument("--check-every", type=int, default=5, help="host cadence: guard.act every N steps")
    ap.add_argument("--save-every", type=int, default=500, help="cadence checkpoints (the guide: 500)")
    ap.add_argument("--snap-every", type=int, default=50)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)

    cfg = rm.ModelConfig(vocab=512, d_model=args.d_model, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                         head_dim=args.d_model // 4, d_ff=4 * args.d_model, sow_attn_logits=False)
    tx = with_lr_scale(optax.adamw(1e-3))
    params = rm.init_params(cfg, jax.random.key(0))
    state0 = State(jnp.zeros([], jnp.int32), params, tx.init(params))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state0))
    batches = [rm.make_batch(i, cfg, 8, 64) for i in range(8)]

    @jax.jit
    def step_fn(state, batch):
        loss, grads = jax.value_and_grad(lambda p: rm.loss_fn(p, batch, cfg)[0])(state.params)
        updates, opt = tx.update(grads, state.opt_state, state.params)
        return State(state.step + 1, optax.apply_updates(state.params, updates), opt), loss

    jax.block_until_ready(step_fn(state0, batches[0]))   # compile outside the timing
    root = Path(args.workdir or tempfile.mkdtemp(prefix="jvitals_snapshots_"))
    times: dict[str, list[float]] = {"a": [], "b": []}
    disk: dict[str, int] = {}
    for block in range(args.blocks):
        for variant in ("a", "b") if block % 2 == 0 else ("b", "a"):
            directory = root / f"{variant}{block}"
            shutil.rmtree(directory, ignore_errors=True)
            snaps = Snapshots(every=args.snap_every, keep=args.keep) if variant == "b" else None
            guard = Rollback(directory, retention=Retention(keep_every=None),
                             save_every=args.save_every, saving=Saving(snapshots=snaps))
            state = state0
            guard.act(0, state, None, 0)                  # the first (cadence) save, untimed
            guard.wait()
            t0 = time.perf_counter()
            for s in range(1, args.steps + 1):
                state, loss = step_fn(state, batches[s % len(batches)])
                if s % args.check_every == 0:
                    jax.device_get(loss)                  # the host's read at its cadence
                    state = guard.respond(s, state, None, s)
            jax.block_until_ready(state)
            guard.wait()                                  # the last snapshot lands inside the timing
            times[variant].append((time.perf_counter() - t0) / args.steps)
            guard.close()
            disk[f"{variant}_ckpt"] = max(disk.get(f"{variant}_ckpt", 0),
                                          dir_bytes(directory) - (dir_bytes(directory / "snapshots")
                                                                  if (directory / "snapshots").exists() else 0))
            if variant == "b":
                disk["snapshots"] = dir_bytes(directory / "snapshots")
                disk["n_snapshots"] = len([p for p in (directory / "snapshots").iterdir() if p.name.isdigit()])
    a, b = statistics.median(times["a"]), statistics.median(times["b"])
    one_ckpt = disk["a_ckpt"]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores); state "
          f"{state_bytes / 2**20:.1f} MiB; act every {args.check_every} steps; cadence save every "
          f"{args.save_every}; snapshots every {args.snap_every}, keep {args.keep}; "
          f"{args.blocks} blocks x {args.steps} steps per variant")
    print(f"per-step time: (a) checkpoints only {a * 1e3:.2f} ms, (b) + snapshots {b * 1e3:.2f} ms, "
          f"ratio (b)/(a) = {b / a:.3f}   (blocks: a {[round(x * 1e3, 2) for x in times['a']]}, "
          f"b {[round(x * 1e3, 2) for x in times['b']]} ms)")
    per = disk["snapshots"] / max(disk["n_snapshots"], 1)
    print(f"disk: snapshots {disk['snapshots'] / 2**20:.2f} MiB ({disk['n_snapshots']} kept) = "
          f"{disk['snapshots'] / state_bytes:.2f} x the train state in memory; one snapshot "
          f"{per / 2**20:.2f} MiB = {per / state_bytes:.2f} x the state (the step-0 checkpoint, "
          f"{one_ckpt / 2**20:.2f} MiB, is smaller: its zero Adam moments compress)")
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
