"""The host side's verdicts, bit for bit: ``Policy()``'s defaults on the whole calibration
corpus (every split and the fault suite's streams, 118 streams) at the README's cadence (a
check every 50 steps, the heavy family every 500) and at every 10, each verdict written out
whole (level, scores, every alert with every field and localization) and hashed per stream
(``tests/verdict_digest.py``), against the digests recorded before the host side was
reorganised (``tests/data/verdict_digests.json``, ``python tests/verdict_digest.py write``).
A change of any verdict on any stream fails here and names the streams.

Re-recorded once since (issue 35, deliberately): the README loop's host sees the output
logits' figures (``jvitals.cross_entropy``) at every check; 20 streams at a check every 50
changed their alerts' localizations (more figures to name), no level, first alert, miss or
healthy alarm changed (``benchmarks/corpus.py score``, every split, both cadences). And once
more when the README's Linen loop read the largest attention logit every step (the replay
gives ``act/attn_logits_abs.max`` at every check): 18 streams at a check every 50 changed,
among them the held-out Llama attention-logit growth, caught at 1450 (missed before), and
one healthy blind YELLOW (the ``logits`` rule, the one the cadence of 10 already had). And
once more when the val-rise rule gained its sparse form (two rises running where ``val/loss``
comes every 500 steps): 9 overfit and repeated-shard streams at a check every 50 changed, each
caught earlier or where it was missed (held-out overfitting on Llama at 2000, the repeated
shard on GPT-2 at 2500); no healthy stream and nothing at a check every 10 changed. And once
more when the group rule judged a parameter norm's growth that does not slow (``group_growth``),
with 4 new TUNING streams (114 -> 118): at both cadences 6 streams changed, each an LM-head drift
or embedding creep caught earlier or where it was missed (held-out: the GPT-2 + Lion embedding
creep at 1900, the Llama head drift at 1500) and the fault suite's ``lr_x100`` gaining a group
YELLOW 400 steps after its fault; no healthy stream changed. Then, at both cadences, the same
9 growth-alert streams' message text only: the growth YELLOW quoted the rise at its opening
beside the rise before as of the latest check (a stale "1.63x over the last 500 steps" at
every later check); both are now the latest check's.
"""

from __future__ import annotations

import json

import pytest

import verdict_digest as vd


@pytest.mark.parametrize("cadence,heavy", vd.CADENCES)
def test_default_policy_gives_the_recorded_verdicts_bit_for_bit(cadence, heavy):
    want = json.loads(vd.GOLDEN.read_text())[f"{cadence}/{heavy}"]
    got = vd.digests(cadences=((cadence, heavy),))[f"{cadence}/{heavy}"]
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    differ = sorted(k for k in want if got[k] != want[k])
    assert not differ, (f"{len(differ)} of {len(want)} streams changed verdicts at checks every {cadence}: "
                        f"{differ[:8]}; see one with: python tests/verdict_digest.py dump {differ[0]} "
                        f"{cadence}/{heavy} OUT")
