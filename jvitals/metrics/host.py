"""Host-side figures: throughput from a step timer, device memory (METRICS.md §3 ``sys/*``).

These are measured on the host, per process, and differ between hosts; the
rollback broadcasts one process's decision so that this never splits a run.
"""

from __future__ import annotations

import contextlib
import numbers
import time
from typing import Callable, Iterator, Sequence

import jax

__all__ = ["StepTimer", "device_memory_metrics"]


class StepTimer:
    """Steps and tokens per second, excluding compilation and checkpoint pauses.

    Formula over a window of ``n`` timed steps and ``k`` tokens between two
    reads: ``sys/steps_per_sec = n / t``, ``sys/tokens_per_sec = k / t``, where
    ``t`` is the wall time between the reads minus the time spent inside
    :meth:`pause` blocks, and the first ``skip_first`` steps (compilation) are
    neither counted nor timed.

    JAX dispatches asynchronously; the host synchronises when it reads metrics
    (``jax.device_get``) at its cadence, so the rate over a window between two
    such reads is the device's rate, while a single step's time is not.

    Example:
      >>> timer = StepTimer(tokens_per_step=8 * 128)
      >>> for step in range(3):
      ...     timer.step()          # after each train step
      >>> with timer.pause():       # a checkpoint save does not count
      ...     pass
      >>> sorted(timer.metrics())   # {} until a window has timed steps
      ['sys/steps_per_sec', 'sys/tokens_per_sec']

    Args:
      tokens_per_step: tokens in one step's global batch (0: no token rate).
      skip_first: steps excluded as compilation/warm-up.
      clock: a monotonic clock in seconds (injectable for tests).

    Raises:
      TypeError/ValueError: ``tokens_per_step`` or ``skip_first`` not an int >= 0, ``clock`` not callable.
    """

    def __init__(self, tokens_per_step: int = 0, *, skip_first: int = 1,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        for name, v in (("tokens_per_step", tokens_per_step), ("skip_first", skip_first)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise (ValueError if isinstance(v, numbers.Integral) else TypeError)(
                    f"StepTimer: {name}={v!r} must be an int >= 0 (tokens_per_step: tokens in one step's "
                    f"global batch, B * T; skip_first: the first steps left out, their compile time)")
        if not callable(clock):
            raise TypeError(f"StepTimer: clock={clock!r} must be a function returning seconds, e.g. time.perf_counter")
        self.tokens_per_step = int(tokens_per_step)
        self.skip_first = int(skip_first)
        self._clock = clock
        self._seen = 0
        self._window_start: float | None = None
        self._steps = 0
        self._tokens = 0
        self._paused = 0.0

    def step(self, tokens: int | None = None) -> None:
        """Record that one train step was dispatched (``tokens`` overrides the default)."""
        self._seen += 1
        if self._seen <= self.skip_first:
            # The window starts when the compiled step is ready to run again.
            self._window_start = None
            return
        if self._window_start is None:
            self._window_start = self._clock()
            self._paused = 0.0
            self._steps = 0
            self._tokens = 0
            return
        self._steps += 1
        self._tokens += self.tokens_per_step if tokens is None else int(tokens)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Exclude the time spent in this block (checkpointing, evaluation)."""
        t0 = self._clock()
        try:
            yield
        finally:
            self._paused += self._clock() - t0

    def metrics(self) -> dict[str, float]:
        """Rates over the window since the last call; ``{}`` if nothing was timed.

        Returns:
          ``{'sys/steps_per_sec': ..., 'sys/tokens_per_sec': ...}`` (the token
          rate only when tokens were counted).
        """
        if self._window_start is None or self._steps == 0:
            return {}
        now = self._clock()
        elapsed = now - self._window_start - self._paused
        if elapsed <= 0:
            return {}
        out = {"sys/steps_per_sec": self._steps / elapsed}
        if self._tokens:
            out["sys/tokens_per_sec"] = self._tokens / elapsed
        self._window_start, self._paused, self._steps, self._tokens = now, 0.0, 0, 0
        return out


def device_memory_metrics(devices: Sequence[jax.Device] | None = None) -> dict[str, float]:
    """Device memory in use and its peak, summed over this process's devices.

    ``sys/device_memory_bytes = sum_d bytes_in_use(d)``,
    ``sys/device_memory_peak_bytes = sum_d peak_bytes_in_use(d)``. Backends
    without ``memory_stats()`` (the CPU) give ``{}``: absent, not zero.

    Args:
      devices: devices to read (default: ``jax.local_devices()``).

    Returns:
      A dict with the two figures, or without those the backend does not report.
    """
    in_use, peak, seen = 0, 0, False
    if isinstance(devices, str) or (devices is not None and not all(hasattr(d, "memory_stats") for d in devices)):
        raise TypeError(f"device_memory_metrics: devices={devices!r:.40} must be a list of jax devices, e.g. "
                        f"jax.local_devices() (None: those), not a platform name")
    for d in devices if devices is not None else jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats:
            continue
        seen = True
        in_use += int(stats.get("bytes_in_use", 0))
        peak += int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))
    if not seen:
        return {}
    return {"sys/device_memory_bytes": float(in_use), "sys/device_memory_peak_bytes": float(peak)}
