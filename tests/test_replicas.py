"""Per-replica figures against NumPy on the gathered per-example values; the layout; the
host side (flat figures, robust z, the rule on streams, the writer, the remedy).

The device figures are checked in both views (``jit`` over ``NamedSharding`` arrays,
``shard_map`` on a ``('data', 'expert')`` mesh, ``pmap``), from raw sown tensors and
from ``instrument()``'s per-token summaries, with padding and non-finite values.
"""

from __future__ import annotations

import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvitals.monitor import config as C
import jvitals as vitals
from jvitals import reference_model as rm
from jvitals.monitor.rules_replicas import replica_summaries, replica_vectors, robust_z

AUTO = jax.sharding.AxisType.Auto


# ----------------------------------------------------------------------------------
# NumPy references.


def np_replicas(r_count, tok=None, mask=None, hidden=(), logits=None):
    """Per-replica figures from whole-batch arrays: rows [r*B/R, (r+1)*B/R) are replica r.

    Non-finite counts: elements of the loss, positions (rows of the trailing axes) of raw
    activations and logits."""
    b = (tok if tok is not None else hidden[0]).shape[0]
    n = b // r_count
    out = {k: [] for k in ("loss", "tokens", "nonfinite", "hidden_states_rms", "hidden_states_abs.max",
                           "output_layer_logits_abs.max")}
    for r in range(r_count):
        rows = slice(r * n, (r + 1) * n)
        m = np.ones(tok.shape if tok is not None else hidden[0].shape[:2], bool) if mask is None else mask
        m = m[rows]
        bad = 0
        if tok is not None:
            t = tok[rows][m].astype(np.float64)
            bad += int((~np.isfinite(t)).sum())
            out["loss"].append(t.sum() / m.sum() if np.isfinite(t).all() else np.nan)
            out["tokens"].append(m.sum())
        if hidden:
            rms, amax, hb = [], [], 0
            for h in hidden:
                v = h[rows][m].astype(np.float64)
                hb += int((~np.isfinite(v)).reshape(len(v), -1).any(-1).sum())   # raw sows: positions
                rms.append(np.sqrt(np.mean(v ** 2)))
                amax.append(np.abs(v).max())
            bad += hb
            out["hidden_states_rms"].append(np.mean(rms) if hb == 0 else np.nan)
            out["hidden_states_abs.max"].append(max(amax) if hb == 0 else np.nan)
        if logits is not None:
            v = logits[rows][m].astype(np.float64)
            lb = int((~np.isfinite(v)).any(-1).sum())                           # raw logits: positions
            bad += lb
            out["output_layer_logits_abs.max"].append(np.abs(v).max() if lb == 0 else np.nan)
        out["nonfinite"].append(bad)
    return {k: np.asarray(v, np.float64) for k, v in out.items() if v}


def check(got, ref, rtol=2e-5):
    got = {k[len("replica/"):]: np.asarray(v) for k, v in got.items()}
    for k, v in ref.items():
        assert k in got, (k, sorted(got))
        np.testing.assert_allclose(got[k], v, rtol=rtol, atol=1e-6, err_msg=k)


def token_loss(logits, labels):
    x = logits.astype(jnp.float32)
    return jax.nn.logsumexp(x, -1) - jnp.take_along_axis(x, labels[..., None], -1)[..., 0]


CFG = rm.ModelConfig(vocab=64, d_model=32, n_layers=2)


@pytest.fixture(scope="module")
def model_run():
    """One forward of the reference model (padded batch of 8): raw sows, per-token loss."""
    params = rm.init_params(CFG, jax.random.key(0))
    batch = rm.make_batch(0, CFG, batch=8, seq=16, pad_fraction=0.25)

    @jax.jit
    def fwd(p, b):
        logits, sown = rm.Decoder(CFG).apply({"params": p}, b["tokens"], mask=b["mask"],
                                             mutable=["intermediates"])
        return logits, sown["intermediates"], token_loss(logits, b["labels"])

    logits, inter, tok = fwd(params, batch)
    hidden = [np.asarray(inter[f"layers_{i}"]["hidden_states"][0]) for i in range(CFG.n_layers)]
    return dict(params=params, batch=batch, logits=np.asarray(logits), inter=inter, tok=np.asarray(tok),
                hidden=hidden, mask=np.asarray(batch["mask"]))


# ----------------------------------------------------------------------------------
# The device figures.


@pytest.mark.parametrize("r_count", [pytest.param(8, marks=pytest.mark.slow), 4, 1])
def test_global_view_raw_sows_match_numpy(model_run, r_count):
    d = model_run
    got = jax.jit(lambda t, m, i: vitals.replica_metrics(loss=t, mask=m, intermediates=i, replicas=r_count))(
        d["tok"], d["mask"], d["inter"])
    assert all(v.shape == (r_count,) and v.dtype == jnp.float32 for v in got.values())
    check(got, np_replicas(r_count, d["tok"], d["mask"], d["hidden"], d["logits"]))


def test_instrument_per_token_summaries_give_the_same_figures(model_run):
    """instrument()'s TokenSummary / LogitsRows (the model's scalar probes skipped) == raw sows."""
    d = model_run
    cfg = rm.ModelConfig(vocab=64, d_model=32, n_layers=2, use_probes=True)

    @jax.jit
    def f(p, b):
        with vitals.instrument():
            logits, sown = rm.Decoder(cfg).apply({"params": p}, b["tokens"], mask=b["mask"],
                                                 mutable=["intermediates"])
        return vitals.replica_metrics(loss=token_loss(logits, b["labels"]), mask=b["mask"],
                                      intermediates=sown, replicas=4)

    check(f(d["params"], d["batch"]), np_replicas(4, d["tok"], d["mask"], d["hidden"], d["logits"]))


@pytest.mark.slow
def test_scan_stacked_sows_and_no_mask():
    cfg = rm.ModelConfig(vocab=32, d_model=16, n_layers=3, scan_layers=True)
    params = rm.init_params(cfg, jax.random.key(1))
    b = rm.make_batch(3, cfg, batch=4, seq=8)
    logits, sown = jax.jit(lambda p, t: rm.Decoder(cfg).apply({"params": p}, t, mutable=["intermediates"]))(
        params, b["tokens"])
    stacked = np.asarray(sown["intermediates"]["layers"]["hidden_states"][0])   # [L, B, T, D]
    assert stacked.shape[0] == 3
    got = vitals.replica_metrics(intermediates=sown, replicas=2)
    ref = np_replicas(2, hidden=list(stacked), logits=np.asarray(logits))
    ref.pop("tokens", None)
    check(got, ref)
    assert "replica/tokens" not in got and "replica/loss" not in got


def test_non_finite_values_stay_on_their_replica():
    rng = np.random.default_rng(0)
    tok = rng.random((8, 6)).astype(np.float32)
    mask = np.ones((8, 6), bool)
    mask[5, 4:] = False
    hid = rng.normal(size=(8, 6, 4)).astype(np.float32)
    logits = rng.normal(size=(8, 6, 5)).astype(np.float32)
    hid[2, 1, 0] = np.nan          # replica 1 (rows 2-3 of 4 replicas)
    logits[7, 0, :2] = np.inf      # replica 3
    tok[5, 5] = np.nan             # replica 2, but padding: never counts
    inter = {"layers_0": {"hidden_states": (hid,)}, "logits": (logits,)}
    got = jax.device_get(vitals.replica_metrics(loss=tok, mask=mask, intermediates=inter, replicas=4))
    np.testing.assert_array_equal(got["replica/nonfinite"], [0, 1, 0, 1])      # positions of raw sows
    assert np.isnan(got["replica/hidden_states_rms"][1]) and np.isnan(got["replica/output_layer_logits_abs.max"][3])
    assert np.isfinite(got["replica/loss"]).all() and got["replica/tokens"][2] == 10
    check(got, np_replicas(4, tok, mask, [hid], logits))


def test_shard_map_on_a_data_expert_mesh_with_local_gradients(devices):
    """Per-device view: figures gathered over 'data' (replicated over 'expert'); the local
    gradient norm psum-s an expert-sharded leaf over 'expert' and a replicated one not."""
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(AUTO,) * 2)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 5, 3)).astype(np.float32)
    mask = rng.random((8, 5)) > 0.3
    mask[:, 0] = True
    w = rng.normal(size=(4, 3)).astype(np.float32)           # [E, D] sharded over 'expert'

    def local(x, m, w):
        tok = jnp.sum(x * x, axis=-1)
        grads = {"dense": jnp.sum(x, axis=(0, 1)), "experts": w * jnp.sum(x)}
        return vitals.replica_metrics(loss=tok, mask=m, intermediates={"hidden_states": x}, grads=grads,
                                      axes="data")

    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = (put(x, P("data")), put(mask, P("data")), put(w, P("expert")))
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data"), P("expert")), out_specs=P()))
    got = jax.device_get(f(*args))
    ref = np_replicas(4, (x * x).sum(-1), mask, [x])
    check(got, ref)
    norms = [np.sqrt((x[2 * r:2 * r + 2].sum((0, 1)) ** 2).sum() + ((w * x[2 * r:2 * r + 2].sum()) ** 2).sum())
             for r in range(4)]
    np.testing.assert_allclose(got["replica/grad_norm"], norms, rtol=1e-5)
    # check_vma=False: JAX does not track what varies; specs= says the expert leaf is sharded.
    g = jax.jit(jax.shard_map(
        lambda x, m, w: vitals.replica_metrics(
            loss=jnp.sum(x * x, -1), mask=m, grads={"dense": jnp.sum(x, (0, 1)), "experts": w * jnp.sum(x)},
            axes=("data",), specs={"dense": P(), "experts": P("expert")}),
        mesh=mesh, in_specs=(P("data"), P("data"), P("expert")), out_specs=P(), check_vma=False))
    np.testing.assert_allclose(jax.device_get(g(*args))["replica/grad_norm"], norms, rtol=1e-5)


def test_global_view_on_a_data_expert_batch_sharding(devices, model_run):
    """The batch over ('data', 'expert') jointly: 8 replicas, one device each."""
    d = model_run
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(AUTO,) * 2)
    sh = NamedSharding(mesh, P(("data", "expert")))
    f = jax.jit(lambda t, m: vitals.replica_metrics(loss=t, mask=m, replicas=8))
    got = f(jax.device_put(d["tok"], sh), jax.device_put(d["mask"], sh))
    check(got, np_replicas(8, d["tok"], d["mask"]))
    text = f.lower(jax.device_put(d["tok"], sh), jax.device_put(d["mask"], sh)).compile().as_text()
    assert "all-gather" not in text, "the batch must not be gathered: only the (R,) vectors cross devices"


def test_pmap_axis(devices):
    rng = np.random.default_rng(2)
    tok = rng.random((8, 2, 3)).astype(np.float32)            # [devices, B_local, T]
    got = jax.pmap(lambda t: vitals.replica_metrics(loss=t, axes="i"), axis_name="i")(tok)
    np.testing.assert_allclose(np.asarray(got["replica/loss"])[0], tok.reshape(8, -1).mean(1), rtol=1e-6)


def test_shard_map_gradients_already_summed_are_refused(devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))

    def local(x, w):
        g = jax.grad(lambda w: jnp.sum(x @ w))(w)           # w replicated: JAX psums the gradient
        return vitals.replica_metrics(loss=jnp.sum(x, -1), grads=g, axes="data")

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
    with pytest.raises(ValueError, match=r"already the same on every shard of \['data'\].*pcast"):
        f(jnp.ones((8, 3)), jnp.ones((3, 2)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(replicas=3), r"B=8 rows, not divisible by replicas=3"),
    (dict(replicas=None), r"under plain jit pass replicas=R"),
    (dict(replicas=8, axes="data"), r"mesh axis 'data' is not bound"),
    (dict(replicas=8, mask=np.ones((8, 7), bool)), r"mask has shape \(8, 7\) but the loss has shape \(8, 6\)"),
    (dict(replicas=8, mask=np.ones((4, 6), bool)), r"mask has shape \(4, 6\); expected .*B=8"),
    (dict(replicas=8, grads={"w": np.ones(3)}), r"gradients are\s+already global.*shard_map"),
    (dict(replicas=8, intermediates={"hidden_states": vitals.summarize(np.ones((8, 6, 2)))}),
     r"'hidden_states' was sown only as batch-reduced \['Summary'\].*instrument"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    kw = dict(loss=np.ones((8, 6), np.float32))
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda **k: vitals.replica_metrics(**k), static_argnames=("replicas", "axes"))(**kw)


def test_compiled_memory_grows_by_the_vectors_only(model_run):
    d = model_run

    def f(p, b, with_replicas):
        logits, sown = rm.Decoder(CFG).apply({"params": p}, b["tokens"], mask=b["mask"], mutable=["intermediates"])
        tok = token_loss(logits, b["labels"])
        out = {"loss": jnp.sum(jnp.where(b["mask"], tok, 0.0)) / jnp.sum(b["mask"])}
        if with_replicas:
            out |= vitals.replica_metrics(loss=tok, mask=b["mask"], intermediates=sown, replicas=8)
        return out

    mem = [jax.jit(functools.partial(f, with_replicas=w)).lower(d["params"], d["batch"]).compile().memory_analysis()
           for w in (False, True)]
    vectors = 6 * 8 * 4                         # six float32 vectors of 8 replicas
    assert vectors <= mem[1].output_size_in_bytes - mem[0].output_size_in_bytes <= vectors + 8 * 8  # + tuple slots
    assert mem[1].temp_size_in_bytes - mem[0].temp_size_in_bytes < 64 * 1024, \
        (mem[0].temp_size_in_bytes, mem[1].temp_size_in_bytes)


# ----------------------------------------------------------------------------------
# Where each replica lives.


def test_layout_of_a_data_expert_mesh(devices):
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(AUTO,) * 2)
    lay = vitals.replica_layout(mesh, "data", hosts=["hostA"])
    grid = np.asarray(mesh.devices)
    assert lay.size == 4 and lay.axes == ("data",)
    for r in range(4):
        assert lay[r].devices == tuple(d.id for d in grid[r])
        assert lay[r].processes == (0, 0) and lay[r].hosts == ("hostA", "hostA")
    assert lay.describe(1).startswith(f"replica 1 (devices {grid[1][0].id} ")
    assert lay.replica_of(grid[2][1].id) == 2
    both = vitals.replica_layout(mesh, ("data", "expert"))
    assert both.size == 8 and [p.devices[0] for p in both.places] == [d.id for d in grid.reshape(-1)]
    assert both[0].hosts == vitals.metrics.placement.process_hostnames()
    assert vitals.ReplicaLayout.from_state_dict(json.loads(json.dumps(both.state_dict()))) == both
    one = vitals.replica_layout(jax.devices()[:3], hosts={0: "h"})
    assert one.size == 3 and one[2].devices == (jax.devices()[2].id,)
    with pytest.raises(ValueError, match=r"the mesh has axes \['data', 'expert'\]; the batch axes \['dp'\]"):
        vitals.replica_layout(mesh, "dp")


# ----------------------------------------------------------------------------------
# Host side: flat figures, scores, summaries.


def test_flat_replicas_and_back():
    host = {"loss": np.float32(1.5), "replica/loss": np.array([1.0, 2.0, 3.0], np.float32),
            "replica/tokens": np.array([4, 5, 6])}
    flat = vitals.flat_replicas(host, data=[2, 0, 1])
    assert flat["loss"] == 1.5 and flat["replica/loss/1"] == 2.0 and flat["replica/data/0"] == 2.0
    assert "replica/loss" not in flat and all(np.ndim(v) == 0 for v in flat.values())
    vec = replica_vectors(flat)
    np.testing.assert_array_equal(vec["loss"], [1, 2, 3])
    np.testing.assert_array_equal(vec["data"], [2, 0, 1])
    with pytest.raises(ValueError, match="data has 2 entries but there are 3 replicas"):
        vitals.flat_replicas(host, data=[0, 1])
    with pytest.raises(ValueError, match="different lengths"):
        vitals.flat_replicas({"replica/a": np.ones(2), "replica/b": np.ones(3)})


def test_robust_z_and_the_writer_summaries():
    x = np.array([1.0, 1.1, 0.9, 1.05, 0.95, 9.0, np.nan, 1.0])
    z, med, s = robust_z(x)
    fin = x[np.isfinite(x)]
    assert med == np.median(fin)
    assert s == pytest.approx(max(1.4826 * np.median(np.abs(fin - med)), 0.02 * abs(med)))
    assert np.isnan(z[6]) and np.nanargmax(np.abs(z)) == 5
    summ = replica_summaries({"loss": x, "nonfinite": np.array([0, 0, 3, 0, 0, 0, 1, 0.0]),
                              "tokens": np.ones(8), "data": np.arange(8.0)})
    assert summ["replica/loss/worst_replica"] == 5 and summ["replica/loss/worst_z"] == pytest.approx(z[5])
    assert summ["replica/nonfinite/replicas"] == 2 and summ["replica/nonfinite/worst_replica"] == 2
    assert not any(k.startswith(("replica/tokens", "replica/data")) for k in summ)


# ----------------------------------------------------------------------------------
# The rule, on streams.

LAYOUT = {"axes": ["data"], "replicas": [
    {"replica": r, "devices": [r], "device_names": [f"cpu:{r}"], "processes": [r // 4], "hosts": [f"host{r // 4}"]}
    for r in range(8)]}


def stream(fault, *, rotate=True, data=True, steps=7, start=3, r_count=8, seed=0):
    rng = np.random.default_rng(seed)
    for s in range(steps):
        loss = 1.0 + 0.05 * rng.normal(size=r_count)
        hid = 1.0 + 0.02 * rng.normal(size=r_count)
        nf = np.zeros(r_count)
        shards = (np.arange(r_count) + (s if rotate else 0)) % r_count
        if s >= start:
            if fault == "device":
                hid[3] *= 1e3
            elif fault == "data":
                loss[np.flatnonzero(shards == 5)[0]] = 4.0
            elif fault == "nan":
                nf[3], hid[3], loss[3] = 100, np.nan, np.nan
            elif fault == "nan_spread":
                nf[:] = 50 if s > start else np.where(np.arange(r_count) == 3, 50, 0)
        host = {"loss": float(np.nanmean(loss)), "replica/loss": loss, "replica/hidden_states_rms": hid,
                "replica/nonfinite": nf, "replica/tokens": np.full(r_count, 32.0)}
        yield s, vitals.flat_replicas(host, data=shards if data else None)


def replay(fault, monitor=None, **kw):
    m = monitor or vitals.Monitor()
    if monitor is None:
        m.rule("replica").layout = LAYOUT
    seen = []
    for s, host in stream(fault, **kw):
        v = m.update(s, host)
        seen += [(s, copy.deepcopy(a)) for a in v.alerts if a.rule == "replica"]   # alerts are live
    return m, seen


def first(seen):
    return seen[0] if seen else (None, None)


def test_a_device_fault_is_named_at_the_second_check_and_suspected_as_the_device():
    _, seen = replay("device")
    s, a = first(seen)
    assert s == 4 and a.level == vitals.Level.YELLOW and a.metric == "replica/hidden_states_rms"
    assert a.details["replica"] == 3 and a.details["devices"] == [3] and a.details["processes"] == [0]
    assert a.details["hosts"] == ["host0"] and a.details["suspect"] == "device"
    assert "replica 3 (device 3 cpu:3, process 0, host host0)" in a.message
    assert "Restart without host host0" in a.message and "do not lower the learning rate" in a.message


def test_a_data_fault_follows_the_shard_across_replicas():
    _, seen = replay("data")
    s, a = first(seen)
    assert s == 4 and a.metric == "replica/loss" and a.details["suspect"] == "data"
    assert a.details["data_seen"] == [5, 5] and len(set(a.details["replicas_seen"])) == 2
    assert "followed data shard 5" in a.message and "Skip or repair data shard 5" in a.message


def test_data_that_never_moves_cannot_tell_and_says_so():
    _, seen = replay("device", rotate=False)
    s, a = first(seen)
    assert s == 4 and a.details["suspect"] == "unknown"
    assert "cannot tell the device from the data: the data never moved" in a.message
    _, seen = replay("device", data=False)
    assert first(seen)[1].details["suspect"] == "unknown" and "no data shards were logged" in first(seen)[1].message


def test_non_finite_on_one_replica_is_orange_at_once_then_suspected():
    _, seen = replay("nan")
    s, a = first(seen)
    assert s == 3 and a.level == vitals.Level.ORANGE and a.metric == "replica/nonfinite"
    assert a.details["replica"] == 3 and "not known after one check" in a.message
    later = [a for st, a in seen if st == 4 and a.metric == "replica/nonfinite"][0]
    assert later.details["suspect"] == "device" and "holds 100 non-finite values while 7 of 8" in later.message


def test_a_non_finite_that_spreads_to_every_replica_keeps_the_first_named():
    _, seen = replay("nan_spread", steps=6)
    named = [(s, a.details["replica"], a.message) for s, a in seen if a.metric == "replica/nonfinite"]
    assert named[0][:2] == (3, 3)
    assert all(r == 3 for _, r, _ in named) and len(named) == 3
    assert "every replica is non-finite now" in named[-1][2] and "was the first, at step 3" in named[-1][2]


def test_the_device_window_names_who_went_first_between_sparse_checks():
    """A NaN on replica 3 at step 12 spreads to all by the check at step 20: the window names it."""
    win = vitals.replica_window_init(8)
    upd = jax.jit(vitals.replica_window_update)
    for step in range(10, 21):
        nf = np.zeros(8, np.float32)
        if step >= 12:
            nf[3] = 7
        if step >= 13:
            nf[:] = 7
        win = upd(win, {"replica/nonfinite": nf}, step)
    figs = jax.device_get(vitals.replica_window_metrics(win))
    np.testing.assert_array_equal(figs["replica/first_nonfinite_step"], [13, 13, 13, 12, 13, 13, 13, 13])
    m = vitals.Monitor()
    m.rule("replica").layout = LAYOUT
    host = vitals.flat_replicas({"replica/nonfinite": np.full(8, 7.0), **figs})
    a = [a for a in m.update(20, host).alerts if a.rule == "replica"][0]
    assert a.level == vitals.Level.ORANGE and a.details["replica"] == 3 and a.details["first_step"] == 12
    assert "went non-finite first, at step 12" in a.message
    a = [a for a in m.update(21, host).alerts if a.rule == "replica"][0]
    assert "replica 3 (device 3 cpu:3, process 0, host host0) was the first, at step 12" in a.message
    with pytest.raises(ValueError, match=r"expected metrics\['replica/nonfinite'\] of shape \(8,\)"):
        vitals.replica_window_update(win, {"replica/nonfinite": np.zeros(4)}, 1)


def test_healthy_noise_and_one_check_blips_raise_nothing():
    m = vitals.Monitor()
    rng = np.random.default_rng(5)
    for s in range(300):
        loss = np.exp(0.1 * rng.normal(size=8)) * (4.0 - s / 100)
        if s % 37 == 0:
            loss[s % 8] *= 3          # a one-check blip on a replica: no alert
        v = m.update(s, vitals.flat_replicas({"replica/loss": loss}, data=(np.arange(8) + s) % 8))
        assert not [a for a in v.alerts if a.rule == "replica"], (s, v.alerts)


def test_two_replicas_name_no_outlier_but_a_nan_still():
    m = vitals.Monitor()
    v = m.update(0, vitals.flat_replicas({"replica/loss": np.array([1.0, 50.0]),
                                          "replica/nonfinite": np.array([0.0, 0.0])}))
    v = m.update(1, vitals.flat_replicas({"replica/loss": np.array([1.0, 50.0]),
                                          "replica/nonfinite": np.array([0.0, 0.0])}))
    assert not v.alerts
    v = m.update(2, vitals.flat_replicas({"replica/loss": np.array([1.0, np.nan]),
                                          "replica/nonfinite": np.array([0.0, 3.0])}))
    assert [a.details["replica"] for a in v.alerts if a.rule == "replica"] == [1]


def test_state_round_trip_mid_streak_and_rollback():
    m, _ = replay("device", steps=4)          # one faulty check seen: streak of 1
    saved = json.loads(json.dumps(m.state_dict()))
    m2 = vitals.Monitor.from_state_dict(saved)
    m2.rule("replica").layout = LAYOUT
    host = dict(stream("device", steps=5))[4]
    a1 = [a for a in m.update(4, host).alerts if a.rule == "replica"]
    a2 = [a for a in m2.update(4, host).alerts if a.rule == "replica"]
    assert [a.message for a in a1] == [a.message for a in a2] and a1
    m2.note_rollback(4, 0)
    assert m2.rule("replica").streaks == {}


def test_policy_fields_are_checked():
    with pytest.raises(ValueError, match=r"ReplicaConfig.min_replicas \(Policy.state_dict key 'replica_min_replicas'\) "
                                         r"expects an integer >= 3"):
        vitals.Monitor(vitals.Policy(replica=C.ReplicaConfig(min_replicas=2)))
    with pytest.raises(ValueError, match=r"ReplicaConfig.min_ratio \(Policy.state_dict key 'replica_min_ratio'\) "
                                         r"expects a value > 1"):
        vitals.Monitor(vitals.Policy(replica=C.ReplicaConfig(min_ratio=1.0)))
    p = vitals.Policy(replica=C.ReplicaConfig(z=5.0))
    assert vitals.Policy.from_state_dict(json.loads(json.dumps(p.state_dict()))) == p


def test_a_layout_of_another_size_is_not_used_for_names():
    m = vitals.Monitor()
    m.rule("replica").layout = {"axes": ["data"], "replicas": LAYOUT["replicas"][:4]}
    _, seen = replay("device", monitor=m)
    assert "replica 3; the layout has 4 replicas, the figures 8" in first(seen)[1].message


# ----------------------------------------------------------------------------------
# Writer, report and the guard's remedy.


class Recorder:
    def __init__(self):
        self.scalars, self.texts, self.hists = {}, {}, {}

    def write_scalars(self, step, s):
        self.scalars.setdefault(step, {}).update(s)

    def write_texts(self, step, t):
        self.texts.setdefault(step, {}).update(t)

    def write_histograms(self, step, h, num_buckets=None):
        self.hists.setdefault(step, {}).update(h)


def test_the_writer_gets_summaries_and_one_text_not_r_scalars():
    m, seen = replay("device", steps=5)
    host = dict(stream("device", steps=5))[4]
    w = Recorder()
    vitals.write(w, 4, host, m.update(5, host))
    sc = w.scalars[4]
    assert not [k for k in sc if k.startswith("replica/") and k.rsplit("/", 1)[-1].isdigit()]
    assert sc["replica/hidden_states_rms/worst_replica"] == 3 and sc["replica/hidden_states_rms/worst_z"] > 100
    figs = json.loads(w.texts[4][vitals.report.writers.REPLICAS_TAG])["figures"]
    assert len(figs["hidden_states_rms"]) == 8 and figs["data"][0] == 4
    assert not w.hists.get(4)
    w2 = Recorder()       # the vectors straight from the device work too
    vitals.write(w2, 1, {"replica/loss": np.array([1.0, 1.0, np.nan])})
    assert json.loads(w2.texts[1][vitals.report.writers.REPLICAS_TAG])["figures"]["loss"][2] is None


def test_report_draws_a_replica_by_step_heat_map(tmp_path):
    pytest.importorskip("matplotlib")
    from jvitals import report as page

    run = page.Run(logdir=str(tmp_path), files=[], scalars={"loss": (np.arange(3), np.ones(3))}, superseded={},
                   texts={page.REPLICAS_TAG: [(s, json.dumps({"figures": {"loss": [1.0, 1.0, 1.0 + s, None]}}))
                                               for s in range(3)]},
                   alerts=[], events=[], hparams={}, warnings=[])
    steps, vals = page.plots.replica_matrices(run)["loss"]
    assert steps.tolist() == [0, 1, 2] and vals.shape == (4, 3) and np.isnan(vals[3, 0])
    assert page.plot_replica_heatmap(run, "loss") is not None
    assert page.plot_replica_heatmap(run, "grad_norm") is None
    html = page.page.build_html(run)
    assert "replica/loss heat map" in html and page.REPLICAS_TAG not in html


def test_the_guard_remedy_names_the_host_and_keeps_the_lr_out_of_it():
    from jvitals.guard.remedies import apply_remedies, parse_remedies

    m, seen = replay("device", steps=5)
    alert = seen[-1][1]
    state, flags, actions = apply_remedies({"x": 1}, [alert], parse_remedies("default"), {}, lr_factor=0.9)
    assert flags["exclude_hosts"] == ["host0"] and flags["exclude_devices"] == [3]
    assert "restart without host host0 (devices 3, replica 3)" in actions[0]["text"]
    assert "a lower learning rate is not the cure" in actions[0]["text"]
    _, seen = replay("data")
    _, flags, actions = apply_remedies({}, [seen[-1][1]], parse_remedies("default"), {})
    assert flags["suspect_data"] == [5] and "data shard 5 is suspect" in actions[0]["text"]
