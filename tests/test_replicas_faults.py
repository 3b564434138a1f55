"""A fault on exactly one device or data shard of a real 8-device training run is named.

The reference model trains for real on 8 forced CPU devices, its data in 8 shards that
rotate over the replicas (replica ``r`` reads shard ``(r + step) % 8``). From a check on,
one fault:

- **device, activations x1e3**: under ``shard_map``, the embedding output of the device
  at ``lax.axis_index('data') == 5`` is multiplied by 1e3 (per-replica figures gathered
  by ``replica_metrics(axes='data')``, local gradient norms before the explicit psum);
- **device, NaN**: the same device's activations times NaN (the optimizer skips
  non-finite updates, ``optax.apply_if_finite``), then the guard's orange and red
  messages;
- **data, random tokens**: under plain ``jit`` (the global view), data shard 5 replaced by
  uniformly random tokens, wherever it goes.

Each must be named -- replica, device, process -- within 2 checks, with the right
suspicion (device vs data). Checks run every step.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jvitals as vitals
from jvitals import reference_model as rm

pytestmark = pytest.mark.slow   # the slow tier: faults injected on one of 8 devices, end to end

CFG = rm.ModelConfig(vocab=64, d_model=32, n_layers=2)
R, PER, SEQ = 8, 2, 16          # 8 replicas, 2 rows each
BAD = 5                         # the sick device's replica / the bad data shard
PRETRAIN = 150


class State(NamedTuple):
    params: Any
    opt_state: Any


def token_loss(logits, labels):
    x = logits.astype(jnp.float32)
    return jax.nn.logsumexp(x, -1) - jnp.take_along_axis(x, labels[..., None], -1)[..., 0]


def scaled_embedding(scale):
    """Flax interceptor: the embedding's output times ``scale``."""
    def icpt(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, nn.Embed) and context.method_name == "__call__":
            return out * scale
        return out
    return icpt


def loader(mesh, bad_shard=None, random_from=None, rotate=True):
    """``batch(step) -> (batch on the mesh, data shard of each replica)``."""
    sharding = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(7)

    def batch(step):
        shards = (np.arange(R) + (step if rotate else 0)) % R
        parts = []
        for j in shards:
            b = {k: np.asarray(v) for k, v in rm.make_batch(int(j) * 7919 + step, CFG, batch=PER, seq=SEQ).items()}
            if bad_shard is not None and j == bad_shard and step >= random_from:
                seq = rng.integers(2, CFG.vocab, size=(PER, SEQ + 1))
                b = {"tokens": seq[:, :-1].astype(np.int32), "labels": seq[:, 1:].astype(np.int32),
                     "mask": np.ones((PER, SEQ), bool)}
            parts.append(b)
        host = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return {k: jax.device_put(v, sharding) for k, v in host.items()}, shards

    return batch


@pytest.fixture(scope="module")
def setup(devices):
    mesh = jax.make_mesh((R,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)), 1000)
    model = rm.Decoder(CFG)

    rep = NamedSharding(mesh, P())       # every output replicated: the inputs of the next call

    @functools.partial(jax.jit, out_shardings=rep)
    def global_step(state, batch):
        def lf(p):
            logits, sown = model.apply({"params": p}, batch["tokens"], mask=batch["mask"],
                                       mutable=["intermediates"])
            tok = token_loss(logits, batch["labels"])
            return jnp.sum(jnp.where(batch["mask"], tok, 0.0)) / jnp.sum(batch["mask"]), (tok, sown)

        (loss, (tok, sown)), g = jax.value_and_grad(lf, has_aux=True)(state.params)
        u, opt = tx.update(g, state.opt_state, state.params)
        m = {"loss": loss} | vitals.replica_metrics(loss=tok, mask=batch["mask"], intermediates=sown, replicas=R)
        return State(optax.apply_updates(state.params, u), opt), m

    def local(params, batch, factor, bad):
        p = lax.pcast(params, ("data",), to="varying")        # local gradients: psum-ed below, by hand
        scale = jnp.where(lax.axis_index("data") == bad, factor, 1.0)

        def lf(p):
            with nn.intercept_methods(scaled_embedding(scale)):
                logits, sown = model.apply({"params": p}, batch["tokens"], mask=batch["mask"],
                                           mutable=["intermediates"])
            tok = token_loss(logits, batch["labels"])
            return jnp.sum(jnp.where(batch["mask"], tok, 0.0)), (tok, sown)

        (s, (tok, sown)), g = jax.value_and_grad(lf, has_aux=True)(p)
        rep = vitals.replica_metrics(loss=tok, mask=batch["mask"], intermediates=sown, grads=g, axes="data")
        n = lax.psum(jnp.sum(batch["mask"], dtype=jnp.float32), "data")
        return lax.psum(s, "data") / n, jax.tree.map(lambda x: lax.psum(x, "data") / n, g), rep

    sm = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P(), P()), out_specs=(P(), P(), P()))

    @functools.partial(jax.jit, out_shardings=rep)
    def device_step(state, batch, factor, bad):
        loss, g, rep = sm(state.params, batch, factor, bad)
        u, opt = tx.update(g, state.opt_state, state.params)
        return State(optax.apply_updates(state.params, u), opt), {"loss": loss} | rep

    params = jax.device_put(rm.init_params(CFG, jax.random.key(0)), rep)
    state = State(params, jax.jit(tx.init, out_shardings=rep)(params))
    batch = loader(mesh)
    for i in range(PRETRAIN):
        state, m = global_step(state, batch(i)[0])
    loss = float(m["loss"])
    assert loss < 2.5, f"pre-training did not learn (loss {loss:.3f})"
    layout = vitals.replica_layout(mesh)
    return dict(mesh=mesh, state=state, global_step=global_step, device_step=device_step, layout=layout)


def run(setup, step_fn, batch, *, checks=5, fault_at=2, guard=None):
    """Train ``checks`` steps from the pre-trained state, checking every step; returns
    ``[(check, alert copies of the replica rule)]`` and the verdicts."""
    monitor = vitals.Monitor()
    monitor.rule("replica").layout = setup["layout"]
    state, seen, verdicts = setup["state"], [], []
    for c in range(checks):
        step = PRETRAIN + c
        b, shards = batch(step)
        state, m = step_fn(state, b, c >= fault_at)
        host = vitals.flat_replicas(jax.device_get(m), data=shards)
        v = monitor.update(step, host)
        verdicts.append(v)
        seen.append((c, [copy.deepcopy(a) for a in v.alerts if a.rule == "replica"]))
        if guard is not None:
            guard(step, state, v, c)
    return seen, verdicts


def first_named(seen):
    for c, alerts in seen:
        if alerts:
            print(f"check {c}: {alerts[0].message}")     # shown with pytest -s
            return c, alerts[0]
    raise AssertionError(f"no replica alert in {len(seen)} checks")


def assert_names_device(setup, a):
    place = setup["layout"][BAD]
    assert a.details["devices"] == list(place.devices) and a.details["processes"] == [0]
    assert a.details["hosts"] == list(set(place.hosts))
    assert place.describe() in a.message


def test_activations_x1e3_on_one_device_is_named_as_the_device(setup):
    step = lambda s, b, on: setup["device_step"](s, b, jnp.float32(1e3 if on else 1.0), jnp.int32(BAD))  # noqa: E731
    seen, _ = run(setup, step, loader(setup["mesh"]))
    c, a = first_named(seen)
    assert c <= 3, f"named at check {c}; the fault began at check 2"
    assert a.level == vitals.Level.YELLOW and a.details["replica"] == BAD
    assert a.details["suspect"] == "device", a.message
    assert_names_device(setup, a)
    figures = {x.metric for x in seen[3][1]}
    assert {"replica/hidden_states_rms", "replica/hidden_states_abs.max"} <= figures, figures


def test_nan_on_one_device_is_orange_at_once_and_the_guard_says_where(setup, tmp_path):
    step = lambda s, b, on: setup["device_step"](s, b, jnp.float32(np.nan if on else 1.0), jnp.int32(BAD))  # noqa: E731
    raising = vitals.Rollback(tmp_path / "pause", save_every=1000, saving=vitals.Saving(pause="raise"),
                              recovery=vitals.Recovery(lr_factor=1.0))
    rolling = vitals.Rollback(tmp_path / "roll", save_every=1000, saving=vitals.Saving(pause="return"),
                              recovery=vitals.Recovery(lr_factor=1.0, remedies="default"))
    paused, rolled = [], []

    def guard(step_no, state, verdict, c):
        try:
            raising.respond(step_no, state, verdict, c)
        except vitals.TrainingPaused as e:
            paused.append(str(e))
        r = rolling.act(step_no, state, verdict, c)
        if r.action is vitals.Action.ROLLBACK:
            rolled.append(rolling.history[-1])

    seen, verdicts = run(setup, step, loader(setup["mesh"]), checks=7, guard=guard)
    c, a = first_named(seen)
    assert c == 2 and a.level == vitals.Level.ORANGE and a.metric == "replica/nonfinite"
    assert a.details["replica"] == BAD
    assert_names_device(setup, a)
    later = [x for x in seen[3][1] if x.metric == "replica/nonfinite"][0]
    assert later.details["suspect"] == "device", later.message
    assert paused and setup["layout"][BAD].describe() in paused[0], paused
    assert rolled, [v.level for v in verdicts]
    texts = [x["text"] for x in rolled[0]["recovery"] if x["kind"] == "remedy"]
    host = setup["layout"][BAD].hosts[0]
    assert any(f"restart without host {host}" in t for t in texts), texts
    assert rolling.remedies["exclude_hosts"] == [host]
    raising.close()
    rolling.close()


def test_random_tokens_on_one_data_shard_are_named_as_the_data(setup):
    batch = loader(setup["mesh"], bad_shard=BAD, random_from=PRETRAIN + 2)
    seen, _ = run(setup, lambda s, b, on: setup["global_step"](s, b), batch)
    c, a = first_named(seen)
    assert c <= 3, f"named at check {c}; the fault began at check 2"
    assert a.metric == "replica/loss" and a.details["suspect"] == "data", a.message
    assert a.details["data_seen"][-2:] == [BAD, BAD]
    r = a.details["replica"]
    assert a.details["devices"] == list(setup["layout"][r].devices) and a.details["processes"] == [0]
    assert f"followed data shard {BAD}" in a.message


def test_a_fault_when_the_data_never_moves_cannot_be_told_apart(setup):
    step = lambda s, b, on: setup["device_step"](s, b, jnp.float32(1e3 if on else 1.0), jnp.int32(BAD))  # noqa: E731
    seen, _ = run(setup, step, loader(setup["mesh"], rotate=False), checks=4)
    c, a = first_named(seen)
    assert c == 3 and a.details["replica"] == BAD and a.details["suspect"] == "unknown"
    assert "the data never moved between replicas" in a.message
