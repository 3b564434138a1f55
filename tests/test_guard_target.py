"""The rollback target as a pure function of (alerts seen, checkpoints on disk).

Every history here is built by hand: alert records (:class:`AlertRecord`) and
checkpoint records (:class:`CheckpointInfo`), no orbax, no JAX arrays, no
monitor. The expected targets are worked out in the comments from the rule in
:func:`choose_target`'s docstring: E = the earliest sign of the chain of alerts
that escalated to the red; cutoff = min(E - onset_margin, the last check before
E); the target is the newest healthy checkpoint below the cutoff (and at most
E - rewind_steps), relapse suspects last.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import types

import pytest

from jvitals.guard.alertlog import AlertLog
from jvitals.guard.target import (
    AlertRecord,
    CheckpointInfo,
    chain,
    choose_target,
    cutoff_before,
    earliest_sign,
    no_target_message,
    Past,
    pick_target,
    pins,
    restore_order,
    RestorePolicy,
)
from jvitals.monitor.types import Level

G, Y, O, R = int(Level.GREEN), int(Level.YELLOW), int(Level.ORANGE), int(Level.RED)
CHECKS = list(range(0, 101, 10))          # the guard checks every 10 steps


def ck(step, level=G, *, quarantined=None, open_peak=G, kind="cadence", store="checkpoints",
       restored_from=None):
    return CheckpointInfo(step, level, kind, restored_from=restored_from, quarantined=quarantined,
                          open_peak=open_peak, store=store)


def al(i, rule, onset, peak, *, closed=None, **kw):
    return AlertRecord(i, rule, onset, peak=peak, closed=closed, **kw)


DISK = [ck(s) for s in (0, 20, 40, 60, 80)]  # a cadence checkpoint every 20 steps, all GREEN


def checks_until(step):
    return [c for c in CHECKS if c <= step]


# ----------------------------------------------------------------------------
# The newest healthy checkpoint before the sign.
# ----------------------------------------------------------------------------


def test_newest_healthy_save_before_the_sign_is_the_target():
    # A spike from step 57 goes RED at the check of step 90. E = 57; the last check
    # before it is 50, so cutoff = min(57 - 1, 50) = 50; below 50 the newest is 40.
    t = choose_target([al(1, "loss_spike", 57, R)], DISK, step=90, past=Past(checks_until(90)))
    assert (t.sign, t.cutoff, t.step) == (57, 50, 40)
    assert [r.step for r in t.candidates] == [40, 20, 0]           # the fallbacks, newest first


def test_a_sign_at_a_check_takes_the_check_before_it():
    # E = 60 is itself a check: the metrics seen at 60 may come from any update in
    # (50, 60], so the checkpoint of 60 is out and so is anything >= 50: target 40.
    t = choose_target([al(1, "grad_norm", 60, R)], DISK, step=90, past=Past(checks_until(90)))
    assert (t.cutoff, t.step) == (50, 40)


def test_without_an_earlier_check_the_margin_decides():
    # No checks before E = 57: cutoff = 57 - onset_margin.
    assert choose_target([al(1, "loss_spike", 57, R)], DISK, step=90).cutoff == 56
    assert choose_target([al(1, "loss_spike", 57, R)], DISK, step=90).step == 40
    # A margin of 20 steps: cutoff 37, so 40 is too new and 20 is the target.
    t = choose_target([al(1, "loss_spike", 57, R)], DISK, step=90, policy=RestorePolicy(onset_margin=20))
    assert (t.cutoff, t.step) == (37, 20)


def test_cutoff_is_the_last_check_before_the_sign_or_the_margin_whichever_is_older():
    assert cutoff_before(57, [0, 10, 50, 60], 1) == 50
    assert cutoff_before(57, [], 1) == 56
    assert cutoff_before(57, [0, 56], 3) == 54                     # the margin is older here
    assert cutoff_before(5, [10, 20], 1) == 4                      # checks after the sign don't count


# ----------------------------------------------------------------------------
# The chain: which alerts' signs count.
# ----------------------------------------------------------------------------


def test_a_closed_blip_does_not_move_the_target_the_escalating_episode_does():
    # Episode 1 of alert id 1: a YELLOW from step 15 that closed at the check of 30
    # without escalating (noise). Episode 2 (a new id, as the monitor opens a new
    # alert when a cleared condition holds again) from step 62, now RED at 90.
    # Only the escalating episode is in the chain: E = 62, cutoff = min(61, 60) = 60,
    # and the target is 40 (not 0, which a sign at 15 would give: cutoff 10).
    alerts = [al(1, "grad_norm", 15, Y, closed=30), al(2, "grad_norm", 62, R)]
    assert chain(alerts) == {2}
    t = choose_target(alerts, DISK, step=90, past=Past(checks_until(90)))
    assert (t.sign, t.cutoff, t.step) == (62, 60, 40)


def test_an_orange_episode_closed_since_the_last_calm_check_is_in_the_chain():
    # An ORANGE alert from step 45 closed at 70; the last check with no ORANGE+ alert
    # open was 40 (calm), so it closed during this fault: E = min(45, 62) = 45,
    # cutoff = min(44, 40) = 40, target 20.
    alerts = [al(3, "update_ratio", 45, O, closed=70), al(2, "grad_norm", 62, R)]
    t = choose_target(alerts, DISK, step=90, past=Past(checks_until(90), calm=40))
    assert (t.sign, t.step) == (45, 20)
    # Had a calm check (no ORANGE+ open) come after it closed (80), it was another
    # episode: E = 62 and the target is 40 again.
    t = choose_target(alerts, DISK, step=90, past=Past(checks_until(90), calm=80))
    assert (t.sign, t.step) == (62, 40)


def test_a_revived_alert_counts_from_the_check_it_held_again():
    # Onset 30, seen clearing, then holding again at the check of 75: its sign is 75,
    # so E = 75, cutoff = min(74, 70) = 70, target 60.
    rec = al(4, "loss_creep", 30, R, revived=75)
    assert rec.sign() == 75
    assert choose_target([rec], DISK, step=90, past=Past(checks_until(90))).step == 60


def test_a_change_point_of_the_localization_is_a_sign_too():
    # Onset 70 but the localization's departure at 33: E = 33, cutoff = min(32, 30) = 30.
    rec = al(5, "update_ratio", 70, R, departures=(33,))
    t = choose_target([rec], DISK, step=90, past=Past(checks_until(90)))
    assert (t.sign, t.cutoff, t.step) == (33, 30, 20)


def test_the_lead_alert_named_by_the_red_one_is_in_the_chain():
    # The RED alert (onset 70) names alert 6 (a YELLOW from 33, closed) as its lead:
    # E = 33, target 20. Without the lead: E = 70, cutoff 60, target 40.
    lead = al(6, "grad_share", 33, Y, closed=50)
    red = al(7, "loss_spike", 70, R, lead=6)
    assert chain([lead, red]) == {6, 7}
    assert choose_target([lead, red], DISK, step=90, past=Past(checks_until(90))).step == 20
    assert choose_target([lead, al(7, "loss_spike", 70, R)], DISK, step=90,
                         past=Past(checks_until(90))).step == 40


def test_an_open_spike_counts_at_yellow_a_periodic_spike_does_not():
    # An open YELLOW loss spike from 44 beside the RED (70): E = 44, cutoff 40, target 20.
    red = al(2, "grad_norm", 70, R)
    assert choose_target([al(8, "loss_spike", 44, Y), red], DISK, step=90,
                         past=Past(checks_until(90))).step == 20
    # A periodic pattern is not a spike: E = 70, target 40.
    assert choose_target([al(8, "periodic_spike", 44, Y), red], DISK, step=90,
                         past=Past(checks_until(90))).step == 40


def test_a_remedied_yellow_in_the_chain_moves_the_target_before_its_onset():
    # An open YELLOW update-ratio alert of the embedding from step 35 and the RED loss
    # spike from 70. Without a remedy the YELLOW is not in the chain: E = 70, cutoff
    # 60, target 40 (after 35: the drift was already under way in it). The guard
    # applies the YELLOW's remedy (the group's LR x0.5), so its onset is the fault's:
    # E = 35, cutoff = min(34, 30) = 30, target 20.
    alerts = [al(9, "update_ratio", 35, Y), al(10, "loss_spike", 70, R)]
    assert choose_target(alerts, DISK, step=90, past=Past(checks_until(90))).step == 40
    t = choose_target(alerts, DISK, step=90, past=Past(checks_until(90)), remedied={9})
    assert (t.sign, t.cutoff, t.step) == (35, 30, 20)
    # An id the guard never saw is ignored.
    assert choose_target(alerts, DISK, step=90, past=Past(checks_until(90)), remedied={99}).step == 40


def test_without_a_chain_the_verdicts_onset_or_the_step_is_the_sign():
    assert earliest_sign([], step=90, onset=55) == 55
    assert earliest_sign([], step=90) == 90
    # A closed YELLOW is no chain: the verdict's onset decides.
    assert earliest_sign([al(1, "grad_norm", 15, Y, closed=30)], step=90, onset=55) == 55


# ----------------------------------------------------------------------------
# Which checkpoints may be restored.
# ----------------------------------------------------------------------------


def test_unhealthy_and_corrupt_checkpoints_are_skipped():
    # Below the cutoff 50: 45 is quarantined (corrupt), 40 was saved while an ORANGE
    # alert was open, 30 was saved at ORANGE: none is healthy; 20 is the target.
    disk = [ck(0), ck(20), ck(30, O, kind="orange"), ck(40, open_peak=O),
            ck(45, quarantined="corrupt: ValueError: torn"), ck(60)]
    t = pick_target(disk, sign=57, cutoff=50, step=90)
    assert [r.step for r in t.candidates] == [20, 0]


def test_a_checkpoint_comes_before_a_snapshot_of_the_same_step():
    disk = [ck(40, store="snapshots", kind="snapshot"), ck(40), ck(45, store="snapshots", kind="snapshot")]
    t = pick_target(disk, sign=57, cutoff=50, step=90)
    assert [(r.step, r.store) for r in t.candidates] == [(45, "snapshots"), (40, "checkpoints"),
                                                         (40, "snapshots")]


def test_rewind_steps_bounds_the_target_too():
    # E = 70, cutoff 60; rewind 25: at most step 45 -> 40; rewind 35: at most 35 -> 20.
    rec = [al(1, "loss_spike", 70, R)]
    t = choose_target(rec, DISK, step=90, past=Past(checks_until(90)), policy=RestorePolicy(rewind_steps=25))
    assert (t.not_after, t.step) == (45, 40)
    t = choose_target(rec, DISK, step=90, past=Past(checks_until(90)), policy=RestorePolicy(rewind_steps=35))
    assert (t.not_after, t.step, t.bound()) == (35, 20, "step 60 and at most step 35")


def test_no_healthy_checkpoint_before_the_sign_says_which_steps_are_on_disk_and_why():
    # The fault from step 25 (cutoff min(24, 20) = 20); on disk only 30 (GREEN) and
    # 40 (ORANGE), both after it: no target. The message names the sign, the bound
    # and each checkpoint with why it is not used.
    disk = [ck(30), ck(40, O, kind="orange")]
    t = choose_target([al(1, "loss_spike", 25, R)], disk, step=50, past=Past(checks_until(50)))
    assert t.step is None and t.candidates == () and (t.sign, t.cutoff) == (25, 20)
    text = no_target_message(t, disk, step=50, where=" in '/ck'")
    assert "red at step 50 (earliest sign 25) but no healthy checkpoint before step 20 in '/ck'" in text
    assert "On disk: 40:ORANGE (saved at ORANGE), 30:GREEN." in text
    assert "['GREEN', 'YELLOW']" in text
    assert "On disk: none." in no_target_message(t, [], step=50)


def test_a_relapse_makes_the_previous_target_suspect_and_an_older_one_is_used():
    # The rollback at step 90 restored 40 (60 and 80 quarantined as sick) and saved
    # the restored state as 90 (restored_from 40). Red again at 100 with no healthy
    # check since (the last one was 90, not after the rollback): 40 and 90 are
    # suspect; the candidates are the healthy ones below the cutoff (20, 0), then the
    # suspect 40 as the last resort.
    disk = [ck(0), ck(20), ck(40), ck(60, quarantined="sick: after rollback target 40"),
            ck(80, quarantined="sick: after rollback target 40"), ck(90, kind="rollback", restored_from=40)]
    history = [{"step": 90, "to_step": 40, "source_step": 40}]
    t = pick_target(disk, sign=95, cutoff=90, step=100, history=history, last_healthy_check=90)
    assert t.relapse_reason.startswith("relapse: red again at step 100")
    assert sorted(r.step for r in t.suspects) == [40, 90]
    assert [r.step for r in t.candidates] == [20, 0, 40]
    assert t.candidates[-1].quarantined == t.relapse_reason
    assert [r.quarantined for r in disk if r.step == 40] == [None]        # inputs untouched
    # A healthy check after the rollback (95): not a relapse, 40 is the target.
    t = pick_target(disk, sign=95, cutoff=90, step=100, history=history, last_healthy_check=95)
    assert t.suspects == () and t.step == 40


def test_resume_order_puts_relapse_suspects_last():
    disk = [ck(0), ck(20, quarantined="relapse: red again"), ck(40, quarantined="sick: after ...")]
    assert [r.step for r in restore_order(disk)] == [0, 20]


def test_pins_keep_what_a_red_from_each_open_alert_would_restore():
    # An open YELLOW from 57: a red from it would restore 40 (cutoff 50); the newest
    # healthy is 80; the previous rollback's target and source are kept.
    got = pins([{"step": 70, "to_step": 20, "source_step": 0}], DISK,
               open_alerts=[al(1, "grad_norm", 57, Y)], checks=checks_until(90))
    assert sorted(got) == [0, 20, 40, 80]
    assert "open alert #1 (grad_norm)" in got[40] and got[80] == "newest healthy"


# ----------------------------------------------------------------------------
# The guard's record of the alerts.
# ----------------------------------------------------------------------------


def _alert(i, level, onset, rule="grad_norm", **kw):
    return types.SimpleNamespace(id=i, rule=rule, level=level, peak_level=kw.pop("peak", level),
                                 onset_step=onset, localization=[], details={}, **kw)


def _verdict(*alerts, closed=(), onset=None):
    return types.SimpleNamespace(alerts=list(alerts), closed_alerts=list(closed), onset_step=onset)


def test_the_alert_log_keeps_episodes_apart_and_revives_a_held_again_alert():
    log = AlertLog()
    log.observe(10, _verdict(_alert(1, Y, 8)))
    log.observe(20, _verdict())                               # gone: closed at 20
    assert log.seen[1].closed == 20 and log.last_calm == 20
    log.observe(30, _verdict(_alert(1, O, 27)))               # same id again: a new episode
    assert (log.seen[1].onset, log.seen[1].closed, log.seen[1].first_check) == (27, None, 30)
    assert log.last_calm == 20                                # an ORANGE is open
    log.observe(40, _verdict(_alert(1, O, 27, clearing_since=38)))
    log.observe(50, _verdict(_alert(1, R, 27)))               # held again after clearing
    assert log.seen[1].revived == 50 and log.seen[1].sign() == 50 and log.seen[1].peak == R
    assert log.chain_sign(_verdict(_alert(1, R, 27)), 50) == 50


# ----------------------------------------------------------------------------
# No orbax, no JAX.
# ----------------------------------------------------------------------------


def test_the_target_module_loads_without_orbax_or_jax():
    root = pathlib.Path(__file__).resolve().parents[1] / "jvitals"
    code = (
        "import sys, types\n"
        f"sys.modules['jvitals'] = types.ModuleType('jvitals'); sys.modules['jvitals'].__path__ = [{str(root)!r}]\n"
        "g = types.ModuleType('jvitals.guard'); g.__path__ = [" + repr(str(root / "guard")) + "]\n"
        "sys.modules['jvitals.guard'] = g\n"
        "import jvitals.guard.target as t\n"
        "bad = [m for m in ('jax', 'orbax', 'orbax.checkpoint', 'optax') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "r = t.choose_target([t.AlertRecord(1, 'loss_spike', 57, peak=3)], [t.CheckpointInfo(40, 0, 'cadence')], step=90)\n"
        "assert r.step == 40, r\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]



def test_choose_targets_old_keywords_are_gone():
    """0.1's keywords (``checks=``, ``rewind_steps=``, ...) live in ``past=Past(...)`` and
    ``policy=RestorePolicy(...)``; Python's own TypeError names the one passed."""
    alerts = [al(1, "loss_spike", 57, R)]
    with pytest.raises(TypeError, match="unexpected keyword argument 'checks'"):
        choose_target(alerts, DISK, step=90, checks=checks_until(90), rewind_steps=35)

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
