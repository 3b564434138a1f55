"""What GPUs and TPUs compile: lowered here for them (lowering needs no device).

Three choices are made by the backend that compiles the step
(``lax.platform_dependent``); the CPU keeps what is fast on XLA:CPU, other
backends take what avoids host round-trips and serialised scatters there. The
values of both sides are checked against NumPy elsewhere (``chunk_elements=0``,
``median='search'``, and ``conftest.nonfinite_path``); here, which one each
backend gets.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

from jvitals import optimizer_metrics

from jvitals.metrics import probes

from jvitals.metrics import stats

ACCELERATORS = ("cuda", "rocm", "tpu")


def lowered(f, *args, platform):
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_logits_probe_chunks_on_the_cpu_only():
    x = jnp.ones((8, 64, 512))  # 2 chunks of 2^17 logits on the CPU
    assert "stablehlo.while" in lowered(probes.summarize_logits, x, platform="cpu")
    for platform in ACCELERATORS:
        assert "stablehlo.while" not in lowered(probes.summarize_logits, x, platform=platform), platform
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
    lambda x: stats.summarize_max([x, x[0]]),
    lambda x: stats.summarize(x, x[:, 0] > 0, axis=1),
    lambda x: stats.summarize_many([(x, None, None), (x[0], None, None)]),
], ids=["sumsq", "max", "summarize", "many"])
def test_nonfinite_counts_are_conditional_on_the_cpu_only(fn):
    """One ``lax.cond`` on the CPU; none elsewhere (``platform_dependent`` itself lowers to
    ``stablehlo.case`` ops on a constant index, the same on every backend)."""
    x = jnp.ones((8, 64))
    cpu = lowered(fn, x, platform="cpu").count("stablehlo.case")
    for platform in ACCELERATORS:
        assert lowered(fn, x, platform=platform).count("stablehlo.case") == cpu - 1, platform
