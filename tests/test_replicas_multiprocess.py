"""Two real JAX processes (gloo on 127.0.0.1, 4 CPU devices each): the layout gathers each
process's host name once, the per-replica figures agree with NumPy on the gathered
per-token losses, and a fault on one device of process 1 is named with its process."""

import json

import numpy as np
import pytest

from multiprocess_util import run_workers

pytestmark = pytest.mark.slow   # the slow tier: a two-process run (tests/test_multiprocess.py is the fast one)

BAD = 6          # replica 6: a device of process 1

WORKER = """
import copy, functools, json
import numpy as np
import flax.linen as nn
import jax, jax.numpy as jnp, optax
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
import jvitals as vitals
from jvitals import reference_model as rm

BAD = %(bad)d
assert jax.process_count() == 2 and jax.device_count() == 8
cfg = rm.ModelConfig(vocab=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
layout = vitals.replica_layout(mesh)               # one process_allgather of the host names
model = rm.Decoder(cfg)
tx = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)), 100)

def token_loss(logits, labels):
    x = logits.astype(jnp.float32)
    return jax.nn.logsumexp(x, -1) - jnp.take_along_axis(x, labels[..., None], -1)[..., 0]

def icpt(scale):
    def f(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        hit = isinstance(context.module, nn.Embed) and context.method_name == "__call__"
        return out * scale if hit else out
    return f

def local(params, batch, factor):
    p = lax.pcast(params, ("data",), to="varying")
    scale = jnp.where(lax.axis_index("data") == BAD, factor, 1.0)
    def lf(p):
        with nn.intercept_methods(icpt(scale)):
            logits, sown = model.apply({"params": p}, batch["tokens"], mask=batch["mask"], mutable=["intermediates"])
        tok = token_loss(logits, batch["labels"])
        return jnp.sum(jnp.where(batch["mask"], tok, 0.0)), (tok, sown)
    (s, (tok, sown)), g = jax.value_and_grad(lf, has_aux=True)(p)
    rep = vitals.replica_metrics(loss=tok, mask=batch["mask"], intermediates=sown, grads=g, axes="data")
    n = lax.psum(jnp.sum(batch["mask"], dtype=jnp.float32), "data")
    return lax.psum(s, "data") / n, jax.tree.map(lambda x: lax.psum(x, "data") / n, g), rep, tok

sm = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=(P(), P(), P(), P("data")))

REP = NamedSharding(mesh, P())

@functools.partial(jax.jit, out_shardings=(REP, REP, REP, NamedSharding(mesh, P("data"))))
def step(params, opt, batch, factor):
    loss, g, rep, tok = sm(params, batch, factor)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), opt, {"loss": loss} | rep, tok

def glob(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])

params = jax.tree.map(lambda a: glob(np.asarray(a), P()), rm.init_params(cfg, jax.random.key(0)))
opt = jax.jit(tx.init, out_shardings=REP)(params)    # the step's own output shardings: no recompile
monitor = vitals.Monitor()
monitor.rule("replica").layout = layout
out = {"layout": layout.state_dict(), "alerts": []}
for c in range(4):
    shards = (np.arange(8) + c) %% 8
    parts = [rm.make_batch(int(j) * 7919 + c, cfg, batch=2, seq=16, pad_fraction=0.2) for j in shards]
    host = {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}
    batch = {k: glob(v, P("data")) for k, v in host.items()}
    params, opt, m, tok = step(params, opt, batch, jnp.float32(1e3 if c >= 1 else 1.0))
    figs = jax.device_get(m)
    if c == 0:
        out["figures"] = {k: np.asarray(v).tolist() for k, v in figs.items()}
        out["tok"] = np.asarray(multihost_utils.process_allgather(tok, tiled=True)).tolist()
        out["mask"] = host["mask"].tolist()
    v = monitor.update(c, vitals.flat_replicas(figs, data=shards))
    out["alerts"] += [dict(check=c, metric=a.metric, **{k: a.details[k] for k in
                      ("replica", "devices", "processes", "hosts", "suspect")}, message=a.message)
                      for a in v.alerts if a.rule == "replica"]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    outs = run_workers(WORKER % {"bad": BAD}, nproc=2, devices_per_process=4, timeout=420,
                       tmp_path=tmp_path_factory.mktemp("mp_replicas"))
    got = []
    for out in outs:
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert line, f"worker printed no result:\n{out[-3000:]}"
        got.append(json.loads(line[-1][len("RESULT "):]))
    return got


def test_both_processes_agree_and_the_layout_names_each_process(results):
    a, b = results
    assert a["figures"] == b["figures"] and a["layout"] == b["layout"] and a["alerts"] == b["alerts"]
    places = a["layout"]["replicas"]
    assert [p["processes"] for p in places] == [[0]] * 4 + [[1]] * 4
    import socket
    assert {h for p in places for h in p["hosts"]} == {socket.gethostname()}


def test_figures_match_numpy_on_the_gathered_per_token_losses(results):
    r = results[0]
    tok, mask = np.asarray(r["tok"]), np.asarray(r["mask"], bool)
    ref = [tok[2 * i:2 * i + 2][mask[2 * i:2 * i + 2]].mean() for i in range(8)]
    np.testing.assert_allclose(r["figures"]["replica/loss"], ref, rtol=2e-5)
    np.testing.assert_array_equal(r["figures"]["replica/tokens"], [mask[2 * i:2 * i + 2].sum() for i in range(8)])
    assert r["figures"]["replica/nonfinite"] == [0.0] * 8 and all(x > 0 for x in r["figures"]["replica/grad_norm"])


def test_a_device_of_process_1_is_named_with_its_process_within_two_checks(results):
    alerts = results[0]["alerts"]
    assert alerts, "no replica alert"
    first = min(a["check"] for a in alerts)
    assert first <= 2, f"named at check {first}; the fault began at check 1"
    a = [x for x in alerts if x["check"] == first][0]
    place = results[0]["layout"]["replicas"][BAD]
    assert a["replica"] == BAD and a["devices"] == place["devices"] and a["processes"] == [1]
    assert a["suspect"] == "device" and "process 1" in a["message"]
