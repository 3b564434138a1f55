"""Host figures: the step timer with an injected clock, and device memory."""

import jax
import pytest

import jvitals as vitals


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_rates_exclude_compilation_and_pauses():
    clock = FakeClock()
    timer = vitals.StepTimer(tokens_per_step=1000, skip_first=1, clock=clock)
    clock.t += 30.0          # the first step compiles for 30 s
    timer.step()
    assert timer.metrics() == {}
    timer.step()             # window starts when the second step returns
    for _ in range(10):      # 10 steps of 0.5 s
        clock.t += 0.5
        timer.step()
    with timer.pause():      # a 7 s checkpoint save
        clock.t += 7.0
    m = timer.metrics()
    assert m["sys/steps_per_sec"] == pytest.approx(10 / 5.0)
    assert m["sys/tokens_per_sec"] == pytest.approx(10 * 1000 / 5.0)
    # the next window starts where this one was read
    for _ in range(4):
        clock.t += 0.25
        timer.step(tokens=500)
    m = timer.metrics()
    assert m["sys/steps_per_sec"] == pytest.approx(4 / 1.0)
    assert m["sys/tokens_per_sec"] == pytest.approx(2000 / 1.0)


def test_no_tokens_no_token_rate():
    clock = FakeClock()
    timer = vitals.StepTimer(clock=clock, skip_first=0)
    timer.step()
    clock.t += 2.0
    timer.step()
    assert timer.metrics() == {"sys/steps_per_sec": pytest.approx(0.5)}


def test_device_memory_is_absent_not_zero_on_cpu():
    assert jax.devices()[0].memory_stats() is None
    assert vitals.device_memory_metrics() == {}


class FakeDevice:
    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_device_memory_sums_devices_that_report():
    devs = [FakeDevice({"bytes_in_use": 10, "peak_bytes_in_use": 30}), FakeDevice(None),
            FakeDevice({"bytes_in_use": 5, "peak_bytes_in_use": 7})]
    assert vitals.device_memory_metrics(devs) == {"sys/device_memory_bytes": 15.0,
                                                  "sys/device_memory_peak_bytes": 37.0}
