"""Two real JAX processes (gloo on 127.0.0.1, 4 CPU devices each) give one process's figures."""

import json

import numpy as np
import pytest

from multiprocess_util import run_workers
from test_stats import np_stats

WORKER = """
import json
import numpy as np
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jvitals as vitals

assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
rng = np.random.default_rng(0)
x = rng.normal(size=(8, 10, 4)).astype(np.float32) * 2 + 0.5
mask = np.zeros((8, 10), bool)
for row in range(8):
    mask[row, : 3 + row] = True          # every shard holds a different number of tokens
x[~mask] = 1e30
w = rng.normal(size=(2, 6, 3)).astype(np.float32)   # [E, D, F] experts over `expert`
mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

def glob(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])

def f(xl, ml, wl):
    tree = {"act": vitals.summarize(xl, ml), "experts": vitals.summarize(wl)}
    return vitals.reduce(tree, ("data", "expert"))

g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data"), P("expert")), out_specs=P()))
out = g(glob(x, P("data")), glob(mask, P("data")), glob(w, P("expert")))
res = {name: {k: float(getattr(s, k)) for k in ("count", "sum", "sumsq", "abs_max", "nonfinite", "mean", "rms", "std")}
       for name, s in out.items()}
# the global (GSPMD) view, across the two processes
gl = jax.jit(lambda a, m: vitals.summarize(a, m))(glob(x, P("data", None)), glob(mask, P("data")))
res["global"] = {k: float(getattr(gl, k)) for k in ("count", "mean", "rms", "abs_max")}
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    outs = run_workers(WORKER, nproc=2, devices_per_process=4, timeout=240,
                       tmp_path=tmp_path_factory.mktemp("mp"))
    results = []
    for out in outs:
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert line, f"worker printed no result:\n{out}"
        results.append(json.loads(line[-1][len("RESULT "):]))
    return results


def make_data():
    """The worker's arrays, made the same way."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 10, 4)).astype(np.float32) * 2 + 0.5
    mask = np.zeros((8, 10), bool)
    for row in range(8):
        mask[row, : 3 + row] = True
    x[~mask] = 1e30
    w = rng.normal(size=(2, 6, 3)).astype(np.float32)
    return x, mask, w


def reference():
    x, mask, w = make_data()
    return np_stats(x, mask[..., None]), np_stats(w)


def test_two_processes_agree_with_each_other_and_with_numpy(worker_results):
    a, b = worker_results
    assert a == b, "both processes must hold the same replicated result"
    act, experts = reference()
    for got, ref in ((a["act"], act), (a["experts"], experts), (a["global"], act)):
        assert got["count"] == ref["count"]
        for k in ("mean", "rms", "abs_max"):
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, err_msg=k)


def test_two_processes_equal_one_process_on_the_whole_array(worker_results):
    import functools

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jvitals as vitals

    x, mask, w = make_data()
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data"), P("expert")), out_specs=P())
    def f(xl, ml, wl):
        return vitals.reduce({"act": vitals.summarize(xl, ml), "experts": vitals.summarize(wl)}, ("data", "expert"))

    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    one = f(put(x, P("data")), put(mask, P("data")), put(w, P("expert")))
    for name in ("act", "experts"):
        for k in ("count", "sum", "sumsq", "abs_max", "nonfinite"):
            np.testing.assert_allclose(worker_results[0][name][k], float(getattr(one[name], k)), rtol=1e-6,
                                       err_msg=f"{name}.{k}")
