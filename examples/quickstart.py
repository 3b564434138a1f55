"""jvitals quickstart: train a small MoE transformer, break it, watch jvitals catch and fix it.

    python examples/quickstart.py                 # CPU, a few hundred steps (its wall time: see the README)
    python examples/quickstart.py --fault none    # the same run, healthy
    python examples/quickstart.py --fault lr      # a learning-rate blow-up instead of bad data

What happens: the reference MoE model (MLA attention with an output gate, an MTP
head, scan-stacked layers) learns a synthetic bigram language. Its optimizer
records gradient vitals (`vitals.record` wrapping the clip), the model sows
compact probe summaries, and every few steps the host reads the metrics once,
asks the Monitor for a verdict, writes everything to TensorBoard through clu and
lets the Rollback guard act. At `--fault-step` a stretch of corrupted batches
(random tokens and labels) begins: the gradient norm leaves its baseline
(yellow, orange: checkpoint and pause), does not come back (red), and the guard
restores the last healthy checkpoint from before the onset with the learning rate
x0.9, while the data position keeps going forward past the bad stretch. The run
recovers; the script ends with a table, writes an HTML report, and exits non-zero
if it did not recover.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
_T0 = time.perf_counter()
if __name__ == "__main__":
    print("jvitals quickstart: importing JAX, optax and jvitals ...", flush=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jvitals as vitals  # noqa: E402
from jvitals import reference_model as rm  # noqa: E402

EVENT_WIDTH = 160  # an event line, cut at a word
COLORS = {"GREEN": "\033[32m", "YELLOW": "\033[33m", "ORANGE": "\033[38;5;208m", "RED": "\033[31m"}


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fault", choices=("lr", "data", "none"), default="lr",
                   help="what to break at --fault-step (none: a healthy run)")
    p.add_argument("--no-fault", dest="fault", action="store_const", const="none")
    p.add_argument("--fault-step", type=int, default=150)
    p.add_argument("--fault-len", type=int, default=30, help="data positions the fault lasts")
    p.add_argument("--fault-mult", type=float, default=100.0, help="--fault lr: step-size multiplier")
    p.add_argument("--check-every", type=int, default=5, help="host cadence: read metrics, monitor, act")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workdir", default="runs/quickstart", help="logs, checkpoints and the report go here")
    p.add_argument("--keep", action="store_true", help="resume from the workdir instead of starting afresh")
    p.add_argument("--no-report", action="store_true")
    return p.parse_args(argv)


def make_config() -> rm.ModelConfig:
    return rm.ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                          attention="mla", q_lora_rank=32, kv_lora_rank=32, attn_gate=True,
                          moe=True, n_experts=4, top_k=2, d_expert=64, n_mtp=1, scan_layers=True,
                          use_probes=True)


def make_train_step(cfg: rm.ModelConfig, tx: optax.GradientTransformation):
    """The jitted step: loss, grads, update, and every vital — no host sync."""

    @jax.jit
    def train_step(state: TrainState, batch: dict, fault_mult: jax.Array):
        def loss_of(params):
            return rm.loss_fn(params, batch, cfg)

        (loss, inter), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: u * fault_mult, updates)  # --fault lr: a blown-up step size
        params = optax.apply_updates(state.params, updates)
        params = rm.update_expert_bias(params, inter, rate=1e-3)  # aux-loss-free balancing
        metrics = {
            "loss": loss,
            "ppl": jnp.exp(loss),
            **vitals.activation_metrics(inter, mask=batch["mask"], labels=batch["labels"]),
            **vitals.moe_metrics(inter, expert_bias=state.params, top_k=cfg.top_k),
            **vitals.optimizer_metrics(opt_state),
        }  # the recorder's figures are read from the state on the host: only the fresh ones
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def batch_at(position: int, cfg: rm.ModelConfig, args: argparse.Namespace) -> dict:
    """The loader: batch `position` of the stream (corrupted inside the data fault)."""
    batch = rm.make_batch(position, cfg, args.batch, args.seq, pad_fraction=0.1)
    if args.fault == "data" and args.fault_step <= position < args.fault_step + args.fault_len:
        rng = np.random.default_rng(10_000 + position)
        noise = rng.integers(2, cfg.vocab, size=batch["tokens"].shape)
        batch = dict(batch, tokens=jnp.asarray(np.where(batch["mask"], noise, cfg.pad_id), jnp.int32),
                     labels=jnp.asarray(rng.integers(2, cfg.vocab, size=noise.shape), jnp.int32))
    return batch


class Progress:
    """A one-line progress bar with the live level (plain lines when not a terminal)."""

    def __init__(self, total: int):
        self.total, self.tty = total, sys.stdout.isatty()
        self.last_plain = -1

    def show(self, step: int, loss: float, level: str) -> None:
        width = 30
        done = int(width * (step + 1) / self.total)
        color, reset = (COLORS.get(level, ""), "\033[0m") if self.tty else ("", "")
        line = (f"[{'#' * done}{'.' * (width - done)}] step {step + 1:4d}/{self.total}  "
                f"loss {loss:6.3f}  level {color}{level:<6}{reset}")
        if self.tty:
            print("\r" + line.ljust(80), end="", flush=True)
        elif step - self.last_plain >= 50 or step + 1 == self.total:
            print(line, flush=True)
            self.last_plain = step

    def event(self, text: str, head: str = "") -> None:
        """One line per event: ``head`` then ``text`` cut at a word (the whole text is in the report)."""
        line = head + textwrap.shorten(text, EVENT_WIDTH - len(head), placeholder=" ... (full text in the report)")
        print(("\r" + " " * 80 + "\r" if self.tty else "") + "  " + line, flush=True)


def say(text: str, t0: float | None = None) -> float:
    """Prints what the demo does now (and, given ``t0``, how long the last thing took)."""
    now = time.perf_counter()
    print(f"[{now - _T0:6.1f} s] {text}" + (f" ({now - t0:.1f} s)" if t0 is not None else ""), flush=True)
    return now


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = _T0
    workdir = Path(args.workdir).absolute()
    if workdir.exists() and not args.keep:
        shutil.rmtree(workdir)
    logdir, ckptdir = workdir / "logs", workdir / "checkpoints"

    t = say("importing the TensorBoard writer (clu imports TensorFlow) ...")
    from clu import metric_writers  # imports tensorflow: after the argument parsing
    say("imported", t)

    t = say("initialising the model and the optimizer (compiles the init), the monitor, the "
            "checkpoint guard and the TensorBoard writer ...")
    cfg = make_config()
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup_steps=20, decay_steps=args.steps,
                                                  end_value=args.lr * 0.1)
    tx = vitals.with_lr_scale(optax.chain(
        vitals.record(optax.clip_by_global_norm(1.0), every={"heavy": args.check_every}),
        optax.adamw(schedule, weight_decay=0.01),
    ))
    params = rm.init_params(cfg, jax.random.key(0))
    state = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))
    # Committed to a device, like a restored checkpoint: a rollback then swaps
    # arrays of the same placement and the step does not recompile.
    state = jax.device_put(state, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    train_step = make_train_step(cfg, tx)

    # METRICS.md §5's windows are for runs of 10^4-10^5 steps; this one has 300,
    # so every window is scaled down (a spike must recover within 20 steps, not 300).
    monitor = vitals.Monitor(vitals.Policy(
        baselines=vitals.BaselineConfig(warmup_steps=20, steps=60),
        spike=vitals.SpikeConfig(trend_halflife=20, scale_halflife=60, min_samples=10, post_window=20,
                                 physiological_steps=20, pathological_steps=30, periodic_min_interval=20),
        health=vitals.HealthConfig(red_after=3), alerts=vitals.AlertConfig(clear_steps=20),
        system=vitals.SystemConfig(event_hold_steps=30), validation=vitals.ValidationConfig(gap_window=100)))
    writer = metric_writers.create_default_writer(str(logdir), just_logging=False)
    # The guard writes rollback/count, rollback/lr_scale and its events (save, pause,
    # rollback) through vitals.write at each of its calls.
    guard = vitals.Rollback(ckptdir, save_every=25, writer=writer,
                            retention=vitals.Retention(keep_every=100))   # keeps the newest 5; LR x0.9, 3 rollbacks
    timer = vitals.StepTimer(tokens_per_step=args.batch * args.seq)

    position = 0
    state, position = guard.resume(state, position, monitor)
    say("ready", t)
    start = int(state.step)
    bar = Progress(args.steps)
    print(f"jvitals quickstart: {args.steps} steps of a {cfg.n_layers}-layer MoE (MLA + gate + MTP) on "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s); fault: {args.fault}"
          + (f" at data position {args.fault_step}" if args.fault != "none" else ""), flush=True)
    losses: dict[int, float] = {}
    levels: dict[int, str] = {}
    level = "GREEN"
    t = say("compiling the train step (the first call; every vital is inside it) ...")
    for step in range(start, args.steps):
        mult = args.fault_mult if (args.fault == "lr" and args.fault_step <= position < args.fault_step + args.fault_len) else 1.0
        state, metrics = train_step(state, batch_at(position, cfg, args), jnp.float32(mult))
        position += 1                      # the data position only ever moves forward
        if step == start:
            jax.block_until_ready(metrics)
            t = say("compiled; training", t)
        timer.step()
        if step % args.check_every and step + 1 != args.steps:
            continue
        host = jax.device_get({**metrics, **vitals.recorded(state.opt_state)})  # one host sync, at the cadence
        host.update(timer.metrics())
        verdict = monitor.update(step, host)
        with timer.pause():                # checkpoint (and pause) time is not throughput
            resp = guard.act(step, state, verdict, position)
            if resp.action == vitals.Action.PAUSE and resp.saved_step is not None:
                time.sleep(1.0)            # what "pause" means here: a breather, then go on
        state = resp.state
        level = verdict.level.name
        losses[step], levels[step] = float(host["loss"]), level
        for a in verdict.new_alerts:      # the level once: the message starts with "[LEVEL] "
            bar.event(a.message.splitlines()[0].removeprefix(f"[{a.level.name}] "),
                      head=f"{a.level.name:<6} step {step}: ")
        if resp.action == vitals.Action.ROLLBACK:
            h = guard.history[-1]
            bar.event(f"ROLLBACK -> checkpoint {resp.target_step} (earliest sign of the fault: step "
                      f"{h['onset_step']}), lr x{resp.lr_scale:.2f}")
        elif resp.action == vitals.Action.PAUSE and resp.saved_step is not None:
            bar.event(f"ORANGE: checkpoint {resp.saved_step} saved; paused 1 s")
        # Scalars and texts only: TensorFlow's histogram summaries are what made the
        # asynchronous writer lag behind (and drain for ~30 s at the end); the
        # per-layer figures are scalars too.
        vitals.write(writer, step, host, verdict, histograms=False)
        bar.show(step, float(host["loss"]), level)
        if (step // args.check_every) % 10 == 0:
            writer.flush()                 # drain the asynchronous TensorBoard writer as we go
    if bar.tty:
        print()
    t = say(f"training done in {time.perf_counter() - t:.1f} s; waiting for the last checkpoint save ...")
    guard.wait()
    t = say("saved; flushing the TensorBoard writer (events still queued) ...", t)
    writer.flush()
    t = say("flushed; closing the writer and the checkpoint manager ...", t)
    guard.close()
    writer.close()
    say("closed", t)

    # The end: did it recover?
    steps = sorted(losses)
    final = float(np.mean([losses[s] for s in steps[-4:]]))
    before = [losses[s] for s in steps if args.fault_step - 40 <= s < args.fault_step]
    pre_fault = float(np.mean(before)) if before else float("nan")
    rollbacks = guard.history
    # The monitor's closed and open alerts, and the guard's (its rollbacks, corrupt checkpoints).
    alerts = [a for a in list(monitor.history) + list(monitor.alerts) if a.rule != "rollback"]
    alerts += list(guard.alerts)
    print("\nAlerts")
    print(f"  {'level':<7}{'rule':<16}{'metric':<26}{'onset':>7}{'step':>7}")
    for a in sorted(alerts, key=lambda a: (a.onset_step, a.step)):
        lvl = getattr(a, "peak_level", a.level)
        print(f"  {lvl.name:<7}{a.rule:<16}{a.metric[:25]:<26}{a.onset_step:>7}{a.step:>7}")
    print("\nRollbacks")
    for r in rollbacks:
        print(f"  at step {r.get('step')}: restored checkpoint {r.get('to_step')}, "
              f"lr scale {r.get('lr_scale', float('nan')):.3f}")
    if not rollbacks:
        print("  none")
    print(f"\nFinal loss {final:.3f} (before the fault {pre_fault:.3f}); final level {level}")
    report = workdir / "report.html"
    if not args.no_report:
        t = say("writing the HTML report (reads the event files back, draws the plots) ...")
        from jvitals import report as report_mod

        report_mod.write_report(str(logdir), str(report), total_steps=args.steps)
        say("written", t)
        print(f"Report:      {report}")
    print(f"TensorBoard: tensorboard --logdir {logdir}")
    print(f"Checkpoints: {ckptdir}")

    if args.fault == "none":
        ok = not rollbacks and level in ("GREEN", "YELLOW")
    else:
        ok = bool(rollbacks) and level in ("GREEN", "YELLOW") and final <= pre_fault * 1.1 + 0.05
    print(f"Wall time:   {time.perf_counter() - t_start:.0f} s (from the start of the script)")
    print("RECOVERED" if ok and args.fault != "none" else ("HEALTHY" if ok else "DID NOT RECOVER"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
