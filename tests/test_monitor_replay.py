"""The host side's verdicts, unchanged: ``Policy()``'s defaults on the whole calibration
corpus (every split and the fault suite's streams, 118 streams) at the README's cadence (a
check every 50 steps, the heavy family every 500) and at every 10, each verdict written out
whole (level, scores, every alert with every field and localization) and recorded per stream
(``tests/verdict_digest.py``): its skeleton (levels, steps, rules, metrics, messages with their
numbers masked) exactly, its numbers within a tolerance, so the test holds on any CPU (another
machine's NumPy kernels may round a last bit differently: ``NPY_DISABLE_CPU_FEATURES`` moves
them here) and fails on any changed verdict, naming the streams.
(``tests/data/verdict_digests.json``, ``python tests/verdict_digest.py write``; what changed
each time it was re-recorded: CHANGELOG.md.)
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import verdict_digest as vd


@pytest.mark.parametrize("cadence,heavy", [vd.CADENCES[0], *(pytest.param(*c, marks=pytest.mark.slow) for c in vd.CADENCES[1:])])
def test_default_policy_gives_the_recorded_verdicts(cadence, heavy):
    want, differ = vd.changed(cadence, heavy)     # a stream gone or new is a difference too
    first = next(iter(differ), "")
    assert not differ, (f"{len(differ)} of {len(want)} streams changed verdicts at checks every {cadence}: "
                        f"{dict(list(differ.items())[:4])}; see one with: python tests/verdict_digest.py dump "
                        f"{first} {cadence}/{heavy} OUT")


def test_the_record_tolerates_a_last_bit_and_catches_a_changed_figure():
    one, two = vd.Numbers(), vd.Numbers()
    for i, x in enumerate((1.2345678901234567, 3.0, 1e-7, 250.0)):
        one.add(x)
        two.add(x * (1 + 2 ** -52) if i == 0 else x)     # another CPU's last bit
    a = {"skeleton": "s", "floats": one.record(), "printed": vd.Numbers().record()}
    b = {"skeleton": "s", "floats": two.record(), "printed": vd.Numbers().record()}
    assert vd.differences(b, a) == []
    three = vd.Numbers()
    for x in (1.2345678901234567, 3.0, 1e-7, 250.5):
        three.add(x)
    c = {"skeleton": "s", "floats": three.record(), "printed": vd.Numbers().record()}
    assert vd.differences(c, a) and vd.differences(dict(a, skeleton="t"), a)
    # A message's printed numbers are masked out of the skeleton and counted.
    p = vd.Numbers()
    assert vd.skeleton("x = 1.5 at step 160 (layer_1)", vd.Numbers(), p) == "x = # at step # (layer_1)"
    assert p.n == 2


@pytest.mark.slow
def test_the_record_holds_under_the_other_numpy_kernels():
    """The README's cadence replayed in a fresh process under the other set of NumPy's CPU
    kernels than this one's (AVX-512 off where it is on, on where it was turned off), against
    the same record."""
    env = dict(os.environ)
    if env.get("NPY_DISABLE_CPU_FEATURES"):
        env.pop("NPY_DISABLE_CPU_FEATURES")
    else:
        env["NPY_DISABLE_CPU_FEATURES"] = "X86_V4 AVX512_ICL"
    here = pathlib.Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, str(here / "verdict_digest.py"), "check", "50/500"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["changed"] == []
