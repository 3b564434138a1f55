"""The guard on a natural instability: the attention-logit growth of a decoder without
qk-layernorm at a high learning rate (``benchmarks/natural.py``'s TUNING pair), trained in the
README's loop with the monitor and the guard on real orbax checkpoints.

With ``Recovery(remedies="default")`` the red verdict's attention-logit alert turns
QK-clip on in flight (the step reads ``vitals.remedy(opt_state, "qk_clip_tau")``): one rollback,
the largest attention logit held below the alert's level afterwards, no relapse, GREEN at the
end. With the learning-rate cut alone the growth comes back after the rollback.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytestmark = pytest.mark.slow

STEPS = 600


def _spec():
    import natural as N

    (pair,) = [p for p in N.PAIRS if p.kind == "attn_logits" and p.shape == "linen-dense" and p.split == "tuning"]
    return dataclasses.replace(N.spec_of(pair, "sick"), steps=STEPS)


def test_the_qk_clip_remedy_ends_the_attention_logit_growth_without_relapse(tmp_path):
    import natural_train as nt

    run = nt.train_guarded(_spec(), str(tmp_path / "remedy"), remedies=True, cadence=50, log=lambda s: None)
    assert len(run.history) == 1, run.history
    (rb,) = run.history
    texts = [a.get("text", "") for a in rb["recovery"] if a.get("kind") == "remedy"]
    assert any(t.startswith("QK-clip at tau=15") and "in flight" in t for t in texts), texts
    assert run.remedies["qk_clip_tau"] == 15.0
    first = [a for a in run.alerts if "attn_logits" in a]
    assert first and first[0].split()[1] == "YELLOW"
    after = [a for a in run.alerts if int(a.split()[0]) > rb["step"]]
    assert not after, after                               # no relapse: nothing opens again
    assert run.level == "GREEN"
    assert np.all(np.isfinite(run.loss[rb["step"]:]))
    # QK-clip holds the largest logit at tau 15, one update's overshoot above it at most
    # (the clip acts after the update, the logit is read before the next one).
    after_clip = run.attn[rb["step"] + 100:]
    assert np.nanmedian(after_clip) < 18.0 and np.nanmax(after_clip) < 25.0


def test_the_lr_cut_alone_lets_the_growth_come_back(tmp_path):
    import natural_train as nt

    run = nt.train_guarded(_spec(), str(tmp_path / "lr"), remedies=False, cadence=50, log=lambda s: None)
    assert run.history, "no rollback"
    first = run.history[0]["step"]
    again = [a for a in run.alerts if int(a.split()[0]) > first and "attn_logits" in a]
    assert again, run.alerts                             # the growth reopens the alert
    assert "qk_clip_tau" not in run.remedies
