"""What GPUs and TPUs compile: lowered here for them (lowering needs no device).

Some choices are made by the backend that compiles the step (``lax.platform_dependent``,
a case on a constant platform index in every lowering, which the compiler folds): the
statistics' form (``jvitals/metrics/fold.py``: plain sibling reductions that GPUs and
TPUs fuse into one read, a variadic reduction on the CPU), the Adam-``nu`` median (a
histogram on the CPU, a search elsewhere: a scatter-add of many equal bins serialises on
GPUs and TPUs), and the non-finite counts the CPU takes only when a norm is not finite
(a ``lax.cond`` there; computed and selected elsewhere: a GPU conditional waits on the
host for its predicate, and the TPU compiler counts both branches). No other
conditional and no loop, anywhere.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

from jvitals import optimizer_metrics
from jvitals.metrics.gradients import norm_metrics

from jvitals.metrics import probes

from jvitals.metrics import stats

ACCELERATORS = ("cuda", "rocm", "tpu")


def lowered(f, *args, platform):
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


_CASE = re.compile(r'^\s*(%[\w#:]+)\s*=\s*"stablehlo\.case"\((%[\w#]+)\)', re.M)
_CONST = re.compile(r'^\s*(%[\w#]+)\s*=\s*stablehlo\.constant', re.M)


def conditionals(text: str) -> int:
    """The ``stablehlo.case`` ops of a lowering that are not ``lax.platform_dependent``'s
    choice of form (a case on a constant platform index, or on such a case's result:
    every lowering holds them, and the compiler folds them)."""
    known = set(_CONST.findall(text))
    real = 0
    for out, arg in _CASE.findall(text):
        if arg in known:
            known.add(out.split(":")[0])
        else:
            real += 1
    return real


def test_logits_probe_is_one_pass_everywhere():
    x = jnp.ones((8, 64, 512))
    for platform in ("cpu",) + ACCELERATORS:
        text = lowered(probes.summarize_logits, x, platform=platform)
        assert "stablehlo.while" not in text and conditionals(text) == 0, platform
    explicit = lowered(lambda a: probes.summarize_logits(a, chunk_elements=1 << 17), x, platform="cuda")
    assert "stablehlo.while" in explicit  # an explicit chunk_elements holds everywhere


def test_adam_nu_median_is_a_histogram_on_the_cpu_only():
    state = optax.adam(1e-3).init({"a": jnp.ones((1000,)), "b": jnp.ones((30, 40))})
    assert "scatter" in lowered(optimizer_metrics, state, platform="cpu")
    assert "scatter" not in lowered(lambda s: optimizer_metrics(s, median="search"), state, platform="cpu")
    for platform in ACCELERATORS:
        assert "scatter" not in lowered(optimizer_metrics, state, platform=platform), platform


@pytest.mark.parametrize("fn", [
    lambda x: stats.summarize_sumsq([x, x[0]]),
    lambda x: stats.summarize_max(x),
    lambda x: stats.summarize(x, x[:, 0] > 0, axis=1),
    lambda x: stats.summarize_many([(x, None, None), (x[0], None, None)]),
], ids=["sumsq", "max", "summarize", "many"])
def test_nonfinite_counts_need_no_conditional_anywhere(fn):
    """The non-finite count is one more reduction of what reads ``x`` (by arithmetic on its
    bits: fold.finite_parts)."""
    x = jnp.ones((8, 64))
    for platform in ("cpu",) + ACCELERATORS:
        text = lowered(fn, x, platform=platform)
        assert conditionals(text) == 0 and "stablehlo.while" not in text, platform


def test_the_maximum_of_many_arrays_counts_under_a_conditional_on_the_cpu_only():
    """summarize_max of a list (Adam nu): on the CPU a plain maximum and the count under a
    lax.cond (stats._max_plain); elsewhere the count is a sibling reduction."""
    x = jnp.ones((8, 64))
    assert conditionals(lowered(lambda a: stats.summarize_max([a, a[0]]), x, platform="cpu")) == 1
    for platform in ACCELERATORS:
        text = lowered(lambda a: stats.summarize_max([a, a[0]]), x, platform=platform)
        assert conditionals(text) == 0 and "stablehlo.while" not in text, platform


def test_light_step_nonfinite_count_is_a_conditional_on_the_cpu_only():
    """norm_metrics (the recorder's light step): a lax.cond on the CPU, where it costs no
    host round trip; a select beside the norm on GPUs and TPUs. (The choice itself is a
    case on a constant platform index, which every lowering holds.)"""
    g = {"a": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    on_cpu = conditionals(lowered(norm_metrics, g, g, g, platform="cpu"))
    without = lowered(lambda a: norm_metrics(a, a, a)["param/global_norm"], g, platform="cpu")
    assert conditionals(without) == 0  # no count asked for: no conditional
    assert on_cpu >= 1
    for platform in ACCELERATORS:
        text = lowered(norm_metrics, g, g, g, platform=platform)
        assert conditionals(text) == 0, platform  # the CPU's cond of the counts: a select here
        assert "stablehlo.while" not in text, platform
