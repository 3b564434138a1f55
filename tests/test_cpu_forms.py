"""The CPU's forms of the statistics (``lax.platform_dependent``: plain reductions XLA:CPU
vectorises, where the one-read form GPUs and TPUs take runs as a serial loop there), each
against NumPy and against the one-read form, healthy and with NaN and Inf:

- the recorder's heavy step: the light step's figures plus the per-role gradient figures by
  plain reductions (``plain_grad_figures``), on the reference model's fused-QKV Llama tree
  and its scan-stacked MoE/MLA tree;
- the logits' row statistics (top-1, top-2, argmax, log-sum-exp, sums, non-finite rows): one
  plain form on every backend, against NumPy;
- the maximum of many arrays (Adam ``nu``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jvitals as vitals
from jvitals import reference_model as rm
from jvitals.metrics import gradients as G

from test_record import applied_change, np_norm

LLAMA = rm.ModelConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                       attention="fused_qkv")
MOE = rm.ModelConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, d_ff=64, attention="mla",
                     q_lora_rank=16, kv_lora_rank=8, attn_gate=True, moe=True, n_experts=4, top_k=2,
                     d_expert=32, n_mtp=1, scan_layers=True)


def _trees(cfg, seed=0):
    params = rm.init_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed + 1)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape).astype(np.float32)), params)
    return params, grads


def _grad_keys(m):
    return {k: v for k, v in m.items() if k.startswith("grad/")}


@pytest.mark.parametrize("cfg", [LLAMA, pytest.param(MOE, marks=pytest.mark.slow)], ids=["fused_qkv", "scan_moe"])
def test_plain_gradient_figures_equal_the_one_read_forms(cfg):
    _, grads = _trees(cfg)
    plain = jax.device_get(jax.jit(G.plain_grad_figures)(grads))
    one = jax.device_get(_grad_keys(jax.jit(lambda g: G.gradient_metrics(g))(grads)))
    assert set(plain) == set(one)
    assert any(k.endswith("_abs.max/layer_1") for k in plain) and "grad/share/layer_1" in plain
    for k in one:
        np.testing.assert_allclose(plain[k], one[k], rtol=2e-6, err_msg=k)


def test_plain_role_figures_against_numpy():
    """The fused QKV kernel's Q, K and V parts (``attn/qkv``: [d, (H + 2 KV) hd], contiguous)
    and the MLP's up projection, each rms and max |g| per layer and over the layers."""
    _, grads = _trees(LLAMA)
    m = jax.device_get(jax.jit(G.plain_grad_figures)(grads))
    hd, nq, nkv = LLAMA.head_dim, LLAMA.n_heads, LLAMA.n_kv_heads
    parts = {"Wq": (0, nq * hd), "Wk": (nq * hd, (nq + nkv) * hd), "Wv": ((nq + nkv) * hd, (nq + 2 * nkv) * hd)}
    per_role = {}
    for i in range(LLAMA.n_layers):
        layer = grads[f"layers_{i}"]
        qkv = np.asarray(layer["attn"]["qkv"]["kernel"], np.float64)
        for name, (lo, hi) in parts.items():
            x = qkv[:, lo:hi]
            per_role.setdefault(name, []).append(x)
            np.testing.assert_allclose(m[f"grad/{name}_rms/layer_{i}"], np.sqrt(np.mean(x ** 2)), rtol=1e-5)
            np.testing.assert_allclose(m[f"grad/{name}_abs.max/layer_{i}"], np.max(np.abs(x)), rtol=1e-6)
        up = np.asarray(layer["mlp"]["up_proj"]["kernel"], np.float64)
        per_role.setdefault("W_up", []).append(up)
        np.testing.assert_allclose(m[f"grad/norm/layer_{i}"], np_norm(layer), rtol=1e-5)
    for name, xs in per_role.items():
        flat = np.concatenate([x.ravel() for x in xs])
        np.testing.assert_allclose(m[f"grad/{name}_rms"], np.sqrt(np.mean(flat ** 2)), rtol=1e-5)
        np.testing.assert_allclose(m[f"grad/{name}_abs.max"], np.max(np.abs(flat)), rtol=1e-6)
        assert int(m[f"grad/{name}.nonfinite"]) == 0
    np.testing.assert_allclose(m["grad/global_norm"], np_norm(grads), rtol=1e-5)


@pytest.mark.parametrize("cfg", [LLAMA, pytest.param(MOE, marks=pytest.mark.slow)], ids=["fused_qkv", "scan_moe"])
def test_a_nan_gradient_is_counted_where_it_is_in_both_forms(cfg):
    _, grads = _trees(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
    # A NaN and an Inf in the first layer's MLP (the slice of layer 1 for a stacked leaf).
    at = next(i for i, (p, x) in enumerate(flat) if "mlp" in jax.tree_util.keystr(p) and x.ndim >= 2)
    path, x = flat[at]
    idx = (1, 0) if cfg.scan_layers else (0, 0)
    x = x.at[idx].set(jnp.nan).at[idx[:-1] + (1,)].set(jnp.inf)
    grads = jax.tree.unflatten(treedef, [x if i == at else v for i, (_, v) in enumerate(flat)])
    plain = jax.device_get(jax.jit(G.plain_grad_figures)(grads))
    one = jax.device_get(_grad_keys(jax.jit(lambda g: G.gradient_metrics(g))(grads)))
    layer = 1 if cfg.scan_layers else 0
    for m in (plain, one):
        assert int(m["grad/nonfinite_count"]) == 2
        assert int(m[f"grad/nonfinite_count/layer_{layer}"]) == 2
        assert int(m[f"grad/nonfinite_count/layer_{1 - layer}"]) == 0
        assert np.isnan(m["grad/global_norm"]) and np.isnan(m[f"grad/norm/layer_{layer}"])
        assert np.isfinite(m[f"grad/norm/layer_{1 - layer}"])
    for k in one:   # NaN where the one-read form is NaN, equal elsewhere
        np.testing.assert_allclose(plain[k], one[k], rtol=2e-6, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [LLAMA, pytest.param(MOE, marks=pytest.mark.slow)], ids=["fused_qkv", "scan_moe"])
def test_the_recorders_heavy_step_on_the_cpu(cfg):
    """record(chain(clip, adamw)) with vitals_heavy=True under jit on this backend: every
    figure ``gradient_metrics`` gives, the gradient ones equal to it, the parameter ones to
    NumPy, the update ratios to NumPy's of the change the step applies."""
    params, grads = _trees(cfg)
    tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    updates, state = jax.jit(lambda g, s, p: tx.update(g, s, p, vitals_heavy=True))(grads, tx.init(params), params)
    m = jax.device_get(vitals.recorded(state))
    one = jax.device_get(jax.jit(lambda g, p, u: G.gradient_metrics(g, params=p, updates=u))(grads, params, updates))
    assert set(one) <= set(m)
    for k, v in _grad_keys(one).items():
        np.testing.assert_allclose(m[k], v, rtol=2e-6, err_msg=k)
    np.testing.assert_allclose(m["param/global_norm"], np_norm(params), rtol=1e-5)
    applied = jax.tree.map(applied_change, params, updates)
    np.testing.assert_allclose(m["update/global_norm"], np_norm(applied), rtol=1e-5)
    np.testing.assert_allclose(m["update/param_ratio"], np_norm(applied) / np_norm(params), rtol=1e-5)
    if not cfg.scan_layers:
        for i in range(cfg.n_layers):
            k = f"layers_{i}"
            np.testing.assert_allclose(m[f"param/norm/layer_{i}"], np_norm(params[k]), rtol=1e-5)
            np.testing.assert_allclose(m[f"update/param_ratio/layer_{i}"],
                                       np_norm(applied[k]) / np_norm(params[k]), rtol=1e-4)
    for k in (k for k in one if k.startswith("update/param_ratio")):
        # The applied change and the update agree to float32's rounding of p + u.
        np.testing.assert_allclose(m[k], one[k], rtol=2e-2, err_msg=k)


# ----------------------------------------------------------------------------------
# The logits' row statistics.


def _logits(seed=0, rows=24, v=96):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(rows, v)) * 4).astype(np.float32)
    x[1, [5, 40]] = x[1].max() + 1.0           # a tie for the maximum: top2 == top1
    x[2, :] = 0.5                               # every entry equal
    return x


def _spoiled(x):
    x = x.copy()
    x[3, 7] = np.nan
    x[4, 9] = np.inf
    x[5, :] = -np.inf
    x[6, :4] = -np.inf
    x[7, [2, 30]] = np.nan
    x[8, 11] = -np.inf
    x[8, 12] = np.inf
    return x


def _np_rows(x):
    """NumPy float64 reference of the row statistics (``probes._row_stats``'s fields): a row
    holding a NaN has NaN top-1 and top-2 and argmax -1; ``nonfinite`` flags a row holding
    a NaN or an infinity, whose sums are not compared (``None`` there)."""
    x = np.asarray(x, np.float64)
    fin = np.isfinite(x)
    bad = ~fin.all(-1)
    has_nan = np.isnan(x).any(-1)
    top1 = np.where(has_nan, np.nan, x.max(-1))
    top2 = np.where(has_nan, np.nan, np.sort(x, axis=-1)[:, -2])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.where(np.isfinite(top1), top1, 0.0)
        lse = np.log(np.sum(np.exp(x - m[:, None]), -1)) + m
    xg = np.where(fin, x, 0.0)
    keep = lambda r: np.where(bad, np.nan, r)  # noqa: E731
    return dict(top1=top1, top2=top2, lse=lse, sum=keep(xg.sum(-1)), sumsq=keep((xg ** 2).sum(-1)),
                abs_max=keep(np.abs(xg).max(-1)), nonfinite=bad, argmax=np.where(has_nan, -1, np.argmax(x, -1)))


_FIELDS = ("top1", "top2", "lse", "sum", "sumsq", "abs_max", "nonfinite", "argmax")


def _close(got, want, scale, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):
        near = np.abs(got - want) <= scale
    assert (same | near).all(), (name, np.nonzero(~(same | near)), got[~(same | near)], want[~(same | near)])


@pytest.mark.parametrize("spoil", [False, True], ids=["finite", "nan_inf"])
def test_logits_row_statistics_against_numpy(spoil):
    """One form on every backend, healthy and with NaN, +-inf and rows of -inf; the sums of a
    row holding a non-finite value are left out (the summary leaves them out too)."""
    from jvitals.metrics import probes as P

    x = _logits()
    x = _spoiled(x) if spoil else x
    ref = _np_rows(x)
    got = jax.device_get(jax.jit(P._row_stats)(jnp.asarray(x)))
    absum = np.abs(np.where(np.isfinite(x), x, 0)).sum(-1).astype(np.float64)
    bad = ref["nonfinite"]
    for name, g in zip(_FIELDS, got):
        scale = {"sum": 1e-6 * absum, "sumsq": 1e-6 * absum ** 2, "lse": 1e-5 * (1 + np.abs(ref["lse"]))}.get(
            name, 0.0)
        if name in ("sum", "sumsq", "abs_max"):
            g = np.where(bad, np.nan, g)
        _close(g, ref[name], scale, name)
    assert got[-1].dtype == np.int32 and bad.any() == spoil


@pytest.mark.slow
def test_the_logits_forms_are_the_same_inside_cpu_plain_and_through_activation_metrics():
    """The logits' figures and argmax have one form: inside cpu_plain() (where instrument() and
    the probes measure their other tensors) they equal those outside it, with no conditional, healthy and with
    NaN and Inf (the argmax NumPy's, -1 for a row holding a NaN), and through
    activation_metrics."""
    import jvitals as vitals
    from jvitals.metrics import fold, probes as P

    x = jnp.asarray(_logits(rows=2 * 12).reshape(2, 12, 96))
    mask = jnp.asarray(np.random.default_rng(2).random((2, 12)) > 0.2)

    def plain(v):
        with fold.cpu_plain():
            return P.summarize_logits(v, mask), P.row_argmax(v)

    hlo = jax.jit(plain).lower(x).compile().as_text()
    assert " conditional(" not in hlo and " while(" not in hlo
    for v in (x, jnp.asarray(_spoiled(np.asarray(x).reshape(24, 96)).reshape(2, 12, 96))):
        (s_plain, a_plain), s_one = jax.jit(plain)(v), jax.jit(lambda v: P.summarize_logits(v, mask))(v)
        xv = np.asarray(v)
        np.testing.assert_array_equal(a_plain, np.where(np.isnan(xv).any(-1), -1, np.argmax(xv, -1)))
        for f in ("logits", "top2_diff", "top2_tie", "lse"):
            a, b = getattr(s_plain, f), getattr(s_one, f)
            for fld in ("count", "sumsq", "abs_max", "nonfinite"):
                np.testing.assert_allclose(getattr(a, fld), getattr(b, fld), rtol=1e-5, err_msg=f"{f}.{fld}")
        np.testing.assert_allclose(s_plain.lse_max, s_one.lse_max, rtol=1e-6)
        got = jax.jit(lambda v: vitals.activation_metrics({"logits": (v,)}, mask=mask))(v)
        np.testing.assert_allclose(got["act/output_layer_logits_rms.avg"], s_one.logits.rms, rtol=1e-5)


# ----------------------------------------------------------------------------------
# The maximum of many arrays.


def test_the_maximum_of_many_arrays_on_the_cpu():
    from jvitals.metrics.stats import _max_one_read, _max_plain, summarize_max

    rng = np.random.default_rng(3)
    xs = [rng.random(s).astype(np.float32) * 10.0 ** rng.uniform(-8, 0) for s in [(64, 48), (300,), (5, 7, 9)]]
    for spoil in (None, np.nan, np.inf, -np.inf):
        arrays = [x.copy() for x in xs]
        if spoil is not None:
            arrays[1][[4, 17]] = spoil
        got = jax.device_get(jax.jit(lambda a: summarize_max(a))([jnp.asarray(a) for a in arrays]))
        flat = np.concatenate([a.ravel() for a in arrays]).astype(np.float64)
        bad = int((~np.isfinite(flat)).sum())
        assert int(got.nonfinite) == bad and float(got.count) == flat.size
        if bad:
            assert np.isnan(got.abs_max)
        else:
            np.testing.assert_allclose(got.abs_max, np.abs(flat).max(), rtol=1e-7)
        plain = jax.jit(_max_plain)([jnp.asarray(a) for a in arrays])
        one = jax.jit(_max_one_read)([jnp.asarray(a) for a in arrays])
        assert int(plain[1]) == int(one[1]) == bad
        if not bad:
            assert float(plain[0]) == float(one[0])


@pytest.mark.slow
def test_one_read_forces_the_accelerators_forms_on_the_cpu():
    """fold.one_read() takes the form a GPU or TPU takes. The recorder's update figures have
    one form on every backend (the change the step applies: with parameters of 1e4 and
    updates of 1e-3, float32 rounds p + u to a multiple of 1e-3, far from the updates' own
    norm), so it changes nothing there; nor on the logits' argmax (one form, no conditional)."""
    from jvitals.metrics import fold, probes as P

    params, grads = _trees(LLAMA)
    params = jax.tree.map(lambda p: p * 0 + 1e4, params)
    tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    step = lambda g, s, p: tx.update(g, s, p, vitals_heavy=True)  # noqa: E731
    u_cpu, s_cpu = jax.jit(step)(grads, tx.init(params), params)
    with fold.one_read():
        u_one, s_one = jax.jit(lambda g, s, p: step(g, s, p))(grads, tx.init(params), params)
    cpu, one = vitals.recorded(s_cpu), vitals.recorded(s_one)
    applied = jax.tree.map(applied_change, params, u_one)
    np.testing.assert_allclose(one["update/global_norm"], np_norm(applied), rtol=1e-5)
    np.testing.assert_allclose(cpu["update/global_norm"], np_norm(applied), rtol=1e-5)
    assert abs(np_norm(applied) / np_norm(u_one) - 1) > 0.01
    x = jnp.asarray(_logits())

    def argmax(v):
        with fold.cpu_plain():
            return P.row_argmax(v)

    with fold.one_read():
        one_hlo = jax.jit(lambda v: argmax(v)).lower(x).as_text()
    assert "conditional" not in one_hlo and "stablehlo.case" not in one_hlo
    np.testing.assert_array_equal(jax.jit(lambda v: argmax(v))(x), np.argmax(_logits(), -1))
