"""Training for the natural-instability corpus: one run of a :class:`Spec`, as the README loop records it.

Imported by ``benchmarks/natural.py`` (the runs, the corpus, the scoring). Every run is real
training on the CPU with jvitals' own recorder in the README's loop::

    tx = vitals.with_lr_scale(vitals.record(optax.chain(clip, adamw(schedule)), schedule=schedule))

nothing injected: the instability comes from the run's settings (a model field of
:class:`natural_models.NatConfig`, the optimizer's epsilon, the warm-up, the precision, the
data's order). Each step stores what the README loop's light step gives (the loss, the
recorder's figures, ``vitals.cross_entropy``'s output-logit figures, the largest attention
logit per layer) and, every ``heavy_every`` steps, the heavy step's (per-role gradients,
every activation, the optimizer's statistics, ``val/loss``). Beside them, under ``check/``
(never shown to the monitor), the corpus' own measurements that confirm the instability
independently: each layer's attention entropy, the output's log Z by ``jax.nn.logsumexp``,
the update RMS per unit learning rate, the loss scale.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jvitals as vitals  # noqa: E402

import corpus_data as cd  # noqa: E402
import natural_models as nm  # noqa: E402

LOSS_SCALE_INIT = 2.0 ** 15
LOSS_SCALE_PERIOD = 200


@dataclasses.dataclass(frozen=True)
class Spec:
    """One natural run.

    Attributes:
      name: unique; ``{kind}/{shape}/{arm}/s{seed}``.
      kind: the instability the pair studies (``attn_logits``, ``output_logits``, ``adam_eps``,
        ``no_warmup``, ``loss_scale``, ``data_shard``).
      arm: ``sick`` or ``control`` (the control differs in one setting).
      api: ``linen`` or ``nnx``.
      model: the architecture.
      data: ``pystdlib``, ``pydocs``, ``pysite`` (byte text) or ``markov2``.
      lr, warmup, steps, end_frac: linear warm-up to ``lr``, cosine to ``end_frac * lr``.
      b2, eps, wd: AdamW's (decay on matrices only).
      batch, seq: B and T.
      z_loss: the z-loss weight (0: off).
      precision: ``fp32`` or ``fp16`` (the model's activations in float16 under a dynamic
        loss scale that halves on a non-finite gradient and skips that update).
      repeat: ``(start, stop, n)``: from ``start`` to ``stop`` the loader serves the same ``n``
        sequences over and over (a data shard repeated), ``()``: off.
      seed: init, data order, padding.
      heavy_every: the heavy step's cadence as stored.
      qk_clip: QK-clip by hand from step 0 at this tau (0: off): ``vitals.qk_clip`` after every
        update with the step's per-layer largest attention logit.
    """

    name: str
    kind: str
    arm: str
    api: str = "linen"
    model: nm.NatConfig = nm.NatConfig()
    data: str = "pystdlib"
    lr: float = 1e-2
    warmup: int = 200
    steps: int = 2000
    end_frac: float = 0.1
    b2: float = 0.95
    eps: float = 1e-8
    wd: float = 0.1
    batch: int = 16
    seq: int = 64
    z_loss: float = 0.0
    precision: str = "fp32"
    repeat: tuple[int, ...] = ()
    seed: int = 0
    heavy_every: int = 50
    qk_clip: float = 0.0
    split: str = "tuning"
    setting: str = ""

    def describe(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = nm.describe(self.model)
        return d


def schedule_of(spec: Spec) -> optax.Schedule:
    if spec.warmup <= 0:
        return optax.cosine_decay_schedule(spec.lr, spec.steps, alpha=spec.end_frac)
    return optax.warmup_cosine_decay_schedule(0.0, spec.lr, spec.warmup, spec.steps, end_value=spec.lr * spec.end_frac)


def optimizer_of(spec: Spec, schedule: optax.Schedule) -> optax.GradientTransformation:
    """The README's recorded chain: clip 1.0, AdamW (decay on matrices), the LR scale outside."""
    mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    adamw = optax.adamw(schedule, b1=0.9, b2=spec.b2, eps=spec.eps, weight_decay=spec.wd, mask=mask)
    return vitals.with_lr_scale(vitals.record(optax.chain(optax.clip_by_global_norm(1.0), adamw),
                                              schedule=schedule))


class Data:
    """Batches as a pure function of the step (text windows or the order-2 Markov language)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.text = cd.load_text(spec.data) if spec.data in cd.TEXT_SOURCES else None
        if spec.repeat:
            self.shard = cd.shard_starts(self.text.train, spec.seed + 77, spec.repeat[2], spec.seq)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        s = self.spec
        seed = s.seed * 1_000_003 + step
        if self.text is None:
            return cd.markov2_batch(seed, s.batch, s.seq, 0.1, s.model.vocab)
        starts = None
        if s.repeat and s.repeat[0] <= step < s.repeat[1]:
            rng = np.random.default_rng(seed)
            starts = self.shard[rng.integers(0, len(self.shard), size=s.batch)]
        return cd.text_batch(self.text.train, seed, s.batch, s.seq, 0.1, starts=starts)

    def val(self) -> list[dict[str, np.ndarray]]:
        s = self.spec
        if self.text is None:
            return [cd.markov2_batch(10 ** 9 + i, s.batch, s.seq, 0.1, s.model.vocab) for i in range(4)]
        return [cd.text_batch(self.text.val, 10 ** 9 + i, s.batch, s.seq, 0.1) for i in range(4)]


def _checks(logits: jax.Array, mask: jax.Array, entropies: list[jax.Array]) -> dict[str, jax.Array]:
    """The corpus' own measurements: attention entropy per layer and its minimum, log Z."""
    valid = mask.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    out = {"check/logz_mean": jnp.sum(lse * valid) / jnp.maximum(jnp.sum(valid), 1.0),
           "check/logz_max": jnp.max(jnp.where(valid > 0, lse, -jnp.inf))}
    for i, e in enumerate(entropies):
        out[f"check/attn_entropy/layer_{i}"] = e
    out["check/attn_entropy.min"] = jnp.min(jnp.stack(entropies))
    return out


def _loss_scale_next(ls: Mapping[str, jax.Array], finite: jax.Array) -> dict[str, jax.Array]:
    """Halve on a non-finite gradient (that update skipped); double after ``LOSS_SCALE_PERIOD``
    finite steps (jmp's dynamic loss scale)."""
    grow = finite & (ls["good"] + 1 >= LOSS_SCALE_PERIOD)
    scale = jnp.where(finite, jnp.where(grow, ls["scale"] * 2.0, ls["scale"]), ls["scale"] / 2.0)
    return dict(scale=scale, good=jnp.where(finite & ~grow, ls["good"] + 1, 0),
                skipped=ls["skipped"] + (~finite).astype(jnp.int32))


def _metrics(spec: Spec, loss, logit_figures, inter, batch, full, opt_state, checks):
    m = {"loss": loss} | logit_figures
    m |= vitals.activation_metrics(inter, mask=batch["mask"], names=("attn_logits",))
    if spec.model.n_experts:
        m |= vitals.moe_metrics(inter, top_k=spec.model.top_k)
    if full:
        m |= vitals.activation_metrics(inter, mask=batch["mask"]) | vitals.optimizer_metrics(opt_state)
    return m | checks


class LinenTrainer:
    """The README's Linen loop's step for a :class:`Spec`."""

    def __init__(self, spec: Spec, qk_tau: Callable[[], float | None] | None = None) -> None:
        self.spec = spec
        self.model = nm.LinenDecoder(spec.model)
        self.schedule = schedule_of(spec)
        self.tx = optimizer_of(spec, self.schedule)
        fp16 = spec.precision == "fp16"
        dt = jnp.float16 if fp16 else jnp.float32

        def forward(params, batch):
            p16 = jax.tree.map(lambda x: x.astype(dt), params)
            logits, sown = self.model.apply({"params": p16}, batch["tokens"], batch["mask"],
                                            mutable=["intermediates", "checks"])
            return logits.astype(jnp.float32), sown

        @functools.partial(jax.jit, static_argnames="full")
        def step(params, opt_state, ls, batch, full, read, z_weight):
            def loss_fn(p):
                logits, sown = forward(p, batch)
                loss, figs = vitals.cross_entropy(logits, batch["labels"], batch["mask"])
                total = loss + vitals.z_loss(logits, batch["mask"], weight=z_weight)
                ent = [e[0] for _, e in sorted(_flat(sown["checks"]).items(), key=lambda kv: _layer(kv[0]))]
                return total * ls["scale"], (loss, figs, sown["intermediates"], _checks(logits, batch["mask"], ent))

            (_, (loss, figs, inter, checks)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            grads = jax.tree.map(lambda g: g / ls["scale"], grads)
            updates, new_opt = self.tx.update(grads, opt_state, params, loss=loss, vitals_heavy=full,
                                              vitals_read=read)
            new = optax.apply_updates(params, updates)
            m = _metrics(spec, loss, figs, inter, batch, full, new_opt, checks)
            if spec.qk_clip:
                per_layer = jnp.stack([m[f"act/attn_logits_abs.max/layer_{i}"] for i in range(spec.model.n_layers)])
                new = vitals.qk_clip(new, per_layer, spec.qk_clip)
            if fp16:
                finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
                new, new_opt = jax.tree.map(lambda a, b: jnp.where(finite, a, b), (new, new_opt), (params, opt_state))
                ls = _loss_scale_next(ls, finite)
                m |= {"opt/loss_scale": ls["scale"], "opt/skipped_steps": ls["skipped"].astype(jnp.float32)}
            m["check/update_rms_per_lr"] = (optax.global_norm(updates) / jnp.sqrt(_size(params))
                                            / jnp.maximum(vitals.recorded(new_opt)["opt/learning_rate"], 1e-30))
            return new, new_opt, ls, m

        @jax.jit
        def val_loss(params, batches):
            tot = 0.0
            for b in batches:
                logits, _ = forward(params, b)
                tot = tot + vitals.cross_entropy(logits, b["labels"], b["mask"])[0]
            return tot / len(batches)

        self.step, self.val_loss = step, val_loss

    def init(self, seed: int) -> Any:
        s = self.spec
        tok = jnp.zeros((1, s.seq), jnp.int32)
        return self.model.init(jax.random.key(seed), tok, jnp.ones((1, s.seq), bool))["params"]


def _flat(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p, simple=True, separator="/"): v
            for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]}


def _layer(path: str) -> int:
    import re
    m = re.search(r"layers[_/](\d+)", path)
    return int(m.group(1)) if m else -1


def _size(tree: Any) -> jax.Array:
    return jnp.float32(sum(x.size for x in jax.tree.leaves(tree)))


class NNXTrainer:
    """The README's NNX loop's step for a :class:`Spec` (the model and optimizer live in NNX
    objects; :meth:`init` builds them)."""

    def __init__(self, spec: Spec) -> None:
        if spec.precision != "fp32":
            raise ValueError("the NNX trainer runs fp32 only")
        self.spec = spec
        self.schedule = schedule_of(spec)

        @nnx.jit(static_argnames="full")
        def step(model, optimizer, batch, full, read, z_weight):
            def loss_fn(model):
                logits, *sown = nnx.capture(lambda m: m(batch["tokens"], batch["mask"]),
                                            nnx.Intermediate, nm.Checks)(model)
                loss, figs = vitals.cross_entropy(logits, batch["labels"], batch["mask"])
                total = loss + vitals.z_loss(logits, batch["mask"], weight=z_weight)
                return total, (loss, figs, sown, logits)

            (_, (loss, figs, sown, logits)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
            inter, chk = sown
            before = nnx.state(model, nnx.Param)
            before = jax.tree.map(lambda x: x + 0, before)
            optimizer.update(model, grads, loss=loss, vitals_heavy=full, vitals_read=read)
            ent = [e[0] for _, e in sorted(_flat(nnx.to_pure_dict(chk)).items(), key=lambda kv: _layer(kv[0]))]
            checks = _checks(logits, batch["mask"], ent)
            m = _metrics(spec, loss, figs, inter, batch, full, optimizer.opt_state, checks)
            after = nnx.state(model, nnx.Param)
            upd = jax.tree.map(lambda a, b: a - b, after, before)
            m["check/update_rms_per_lr"] = (optax.global_norm(upd) / jnp.sqrt(_size(after))
                                            / jnp.maximum(vitals.recorded(optimizer.opt_state)["opt/learning_rate"],
                                                          1e-30))
            return m

        @nnx.jit
        def val_loss(model, batches):
            # Under nnx.capture as in the step: a call outside it would leave the sown values in
            # the model, whose changed graph retraces every jitted call after it.
            tot = 0.0
            for b in batches:
                logits, *_ = nnx.capture(lambda m: m(b["tokens"], b["mask"]), nnx.Intermediate, nm.Checks)(model)
                tot = tot + vitals.cross_entropy(logits, b["labels"], b["mask"])[0]
            return tot / len(batches)

        self.step, self.val_loss = step, val_loss

    def init(self, seed: int) -> tuple[Any, Any]:
        model = nm.NNXDecoder(self.spec.model, nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optimizer_of(self.spec, self.schedule), wrt=nnx.Param)


def _host(metrics: Mapping[str, Any], rec: Any) -> dict[str, Any]:
    """One transfer of the step's metrics and the recorder's packed vector, merged on the host
    (unpacking the vector on the device first would transfer each figure apart)."""
    m, r = jax.device_get((metrics, rec))
    return {**m, **r}


def _row(host: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in host.items() if not k.startswith("window/")}


def train(spec: Spec, log: Callable[[str], None] = print) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Train ``spec``; ``(rows, facts)``: ``rows[s]`` every figure of step ``s``."""
    data = Data(spec)
    val = jax.device_put(data.val())
    rows: list[dict[str, float]] = []
    t0 = time.perf_counter()
    zw = jnp.float32(spec.z_loss)
    if spec.api == "nnx":
        tr = NNXTrainer(spec)
        model, optimizer = tr.init(spec.seed)
        for step in range(spec.steps):
            full = step % spec.heavy_every == 0
            m = tr.step(model, optimizer, jax.device_put(data.batch(step)), full, True, zw)
            row = _row(_host(m, vitals.recorded(optimizer.opt_state)))
            if full:
                row["val/loss"] = float(tr.val_loss(model, val))
            rows.append(row)
            _progress(log, spec, step, row, t0)
        n_params = sum(int(np.size(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    else:
        tr = LinenTrainer(spec)
        params = tr.init(spec.seed)
        opt_state = tr.tx.init(params)
        ls = dict(scale=jnp.float32(LOSS_SCALE_INIT if spec.precision == "fp16" else 1.0),
                  good=jnp.int32(0), skipped=jnp.int32(0))
        for step in range(spec.steps):
            full = step % spec.heavy_every == 0
            params, opt_state, ls, m = tr.step(params, opt_state, ls, jax.device_put(data.batch(step)), full,
                                               True, zw)
            row = _row(_host(m, vitals.recorded(opt_state)))
            if full:
                row["val/loss"] = float(tr.val_loss(params, val))
            rows.append(row)
            _progress(log, spec, step, row, t0)
        n_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    facts = dict(wall_s=time.perf_counter() - t0, n_params=n_params)
    return rows, facts


def _progress(log, spec, step, row, t0):
    if step % 500 == 0 or step == spec.steps - 1:
        log(f"  {spec.name} step {step}/{spec.steps} loss {row['loss']:.3f} "
            f"attn {row.get('act/attn_logits_abs.max', float('nan')):.4g} "
            f"ent {row.get('check/attn_entropy.min', float('nan')):.3g} "
            f"logZ {row.get('check/logz_mean', float('nan')):.3g} "
            f"{(time.perf_counter() - t0) / (step + 1) * 1e3:.1f} ms/step")


class GuardedRun(NamedTuple):
    """A run under the guard: every step's loss and largest attention logit, the guard's
    rollbacks, its remedies' flags, its level at the end and every alert opening or escalating
    (``"{step} {LEVEL} {rule}:{metric}"``)."""

    loss: np.ndarray
    attn: np.ndarray
    history: list[dict[str, Any]]
    remedies: dict[str, Any]
    level: str
    alerts: list[str]


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


def train_guarded(spec: Spec, ckpt_dir: str, *, remedies: bool, cadence: int = 50, save_every: int = 100,
                  heavy_every: int = 500, log: Callable[[str], None] = print) -> GuardedRun:
    """``spec`` (Linen, fp32) in the README's loop with the monitor and the guard on orbax
    checkpoints, the step applying the guard's in-flight remedies (QK-clip at
    ``vitals.remedy(opt_state, "qk_clip_tau")``, the z-loss at ``vitals.remedy(opt_state,
    "z_loss")``); ``remedies``: ``Recovery(remedies="default")`` or the LR cut alone."""
    model = nm.LinenDecoder(spec.model)
    schedule = schedule_of(spec)
    tx = optimizer_of(spec, schedule)
    data = Data(spec)

    @functools.partial(jax.jit, static_argnames="full")
    def train_step(state, batch, full=False, read=True):
        def loss_fn(params):
            logits, sown = model.apply({"params": params}, batch["tokens"], batch["mask"],
                                       mutable=["intermediates"])
            loss, figs = vitals.cross_entropy(logits, batch["labels"], batch["mask"])
            z = vitals.z_loss(logits, batch["mask"], weight=vitals.remedy(state.opt_state, "z_loss"))
            return loss + z, (loss, sown["intermediates"], figs)

        (_, (loss, inter, figs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params, loss=loss, vitals_heavy=full,
                                       vitals_read=read)
        metrics = {"loss": loss} | figs
        metrics |= vitals.activation_metrics(inter, mask=batch["mask"], names=("attn_logits",))
        if full:
            metrics |= vitals.activation_metrics(inter, mask=batch["mask"]) | vitals.optimizer_metrics(opt_state)
        params = vitals.qk_clip(optax.apply_updates(state.params, updates), metrics,
                                vitals.remedy(opt_state, "qk_clip_tau"))
        return TrainState(state.step + 1, params, opt_state), metrics

    params = model.init(jax.random.key(spec.seed), jnp.zeros((1, spec.seq), jnp.int32),
                        jnp.ones((1, spec.seq), bool))["params"]
    state, position = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), 0
    monitor = vitals.Monitor()
    recovery = vitals.Recovery(remedies="default" if remedies else None, max_rollbacks=None)
    guard = vitals.Rollback(ckpt_dir, save_every=save_every, recovery=recovery)
    state, position = guard.resume(state, position, monitor)
    losses = np.full(spec.steps, np.nan)
    attn = np.full(spec.steps, np.nan)
    alerts: list[str] = []
    seen: dict[int, int] = {}
    for step in range(int(state.step), spec.steps):
        check = step % cadence == 0
        state, metrics = train_step(state, jax.device_put(data.batch(position)), full=step % heavy_every == 0,
                                    read=check)
        position += 1
        losses[step], attn[step] = (float(x) for x in jax.device_get(
            (metrics["loss"], metrics["act/attn_logits_abs.max"])))
        if check:
            host = jax.device_get({**metrics, **vitals.recorded(state.opt_state)})
            verdict = monitor.update(step, host)
            for a in verdict.alerts:
                if int(a.level) > seen.get(a.id, 0):
                    seen[a.id] = int(a.level)
                    alerts.append(f"{step} {a.level.name} {a.rule}:{a.metric}")
            state = guard.respond(step, state, verdict, position)
    guard.close()
    return GuardedRun(losses, attn, list(guard.history), dict(guard.remedies), guard.level.name, alerts)
