"""What GPUs and TPUs compile: lowered here for them (lowering needs no device).

One choice is still made by the backend that compiles the step
(``lax.platform_dependent``): the Adam-``nu`` median is a histogram on the CPU and a
search elsewhere (a scatter-add of many equal bins serialises on GPUs and TPUs).
The recorder's light step counts non-finite gradients only when their norm is not
finite: under a ``lax.cond`` on the CPU, computed and selected elsewhere (a GPU
conditional waits on the host for its predicate). Everything else is the same
program on every backend: one variadic reduction per tensor
(``jvitals/metrics/fold.py``), with no conditional and no loop.
"""

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


def test_logits_probe_is_one_pass_everywhere():
    x = jnp.ones((8, 64, 512))
    for platform in ("cpu",) + ACCELERATORS:
        text = lowered(probes.summarize_logits, x, platform=platform)
        assert "stablehlo.while" not in text and "stablehlo.case" not in text, platform
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
    """The non-finite count is one more operand of the reduction that reads ``x``."""
    x = jnp.ones((8, 64))
    for platform in ("cpu",) + ACCELERATORS:
        text = lowered(fn, x, platform=platform)
        assert "stablehlo.case" not in text and "stablehlo.while" not in text, platform


def test_the_maximum_of_many_arrays_counts_under_a_conditional_on_the_cpu_only():
    """summarize_max of a list (Adam nu): on the CPU a plain maximum and the count under a
    lax.cond (stats._max_plain); elsewhere one reduction with the count as an operand."""
    x = jnp.ones((8, 64))
    on_cpu = lowered(lambda a: stats.summarize_max([a, a[0]]), x, platform="cpu").count("stablehlo.case")
    for platform in ACCELERATORS:
        text = lowered(lambda a: stats.summarize_max([a, a[0]]), x, platform=platform)
        assert text.count("stablehlo.case") == on_cpu - 1 and "stablehlo.while" not in text, platform


def test_light_step_nonfinite_count_is_a_conditional_on_the_cpu_only():
    """norm_metrics (the recorder's light step): a lax.cond on the CPU, where it costs no
    host round trip; a select beside the norm on GPUs and TPUs. (The choice itself is a
    case on a constant platform index, which every lowering holds.)"""
    g = {"a": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    on_cpu = lowered(norm_metrics, g, g, g, platform="cpu").count("stablehlo.case")
    without = lowered(lambda a: norm_metrics(a, a, a)["param/global_norm"], g, platform="cpu")
    assert "stablehlo.case" not in without  # no count asked for: no conditional, no choice
    for platform in ACCELERATORS:
        text = lowered(norm_metrics, g, g, g, platform=platform)
        assert text.count("stablehlo.case") == on_cpu - 1, platform  # the CPU's cond of the gradients' count
        assert "stablehlo.while" not in text, platform
