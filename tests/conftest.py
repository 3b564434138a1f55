"""Test set-up: eight host CPU devices, set before JAX is imported anywhere."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One XLA compilation cache for the session: this process, the xdist workers and every
# subprocess a test starts (quickstart, README blocks, the notebook, multi-process runs)
# inherit it, so a program several files compile (the reference model's steps) is
# compiled once. A fresh directory each session, removed at its end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jvitals-tests-xla-cache-")
    os.environ["JVITALS_TESTS_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_unconfigure(config):
    if os.environ.get("JVITALS_TESTS_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 forced CPU devices, got {len(devs)}"
    return devs


class CompileCounter:
    """Counts XLA backend compiles (not cache hits) while active."""

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def _unregister_private(callback):
    from jax._src import monitoring

    monitoring.unregister_event_duration_listener(callback)


@pytest.fixture
def count_compiles():
    """``with count_compiles() as c: ...; assert c.count == 0``."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        counter = CompileCounter()
        jax.monitoring.register_event_duration_secs_listener(counter)
        try:
            yield counter
        finally:
            getattr(jax.monitoring, "unregister_event_duration_listener", _unregister_private)(counter)

    return ctx


def assert_second_calls_compile_nothing(calls, count_compiles):
    """Calls each of ``calls`` twice (eagerly); asserts the second round compiles
    nothing and gives the same arrays. Returns the first round's results."""
    import numpy as np

    first = [jax.device_get(f()) for f in calls]  # warm: compiles once each
    with count_compiles() as c:
        again = [jax.device_get(f()) for f in calls]
    assert c.count == 0, f"{c.count} compiles on the second eager calls"
    for a, b in zip(first, again):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(u, v)
    return first


def pytest_configure(config):
    """Keep the order below: xdist's ``--dist loadfile`` would otherwise hand out the files with
    the most tests first (its ``loadscopereorder``), whatever their length."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4 (each worker holds 8 forced CPU
    devices, a TensorFlow import and compiled models: ~2-3 GB)."""
    return max(1, min(os.cpu_count() or 1, 4))


# The fast tier's longest files, longest first (measured with --durations).
LONGEST_FIRST = ("test_record.py", "test_role_families.py", "test_monitor.py", "test_rollback.py",
                 "test_activations.py", "test_nnx.py", "test_readme.py", "test_gradients.py",
                 "test_optimizer_metrics.py", "test_instrument.py")


def pytest_collection_modifyitems(config, items):
    """The end-to-end files (``slow``) first, then the fast tier's longest files: with ``--dist
    loadfile`` each file runs whole on one worker, so the longest ones start early beside the
    short ones instead of ending the run alone."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (0 if item.get_closest_marker("slow") else 1,
                                 rank.get(item.path.name, len(rank))))
