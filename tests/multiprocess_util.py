"""Run a Python script as N real JAX processes on 127.0.0.1 (gloo CPU collectives).

Each worker gets the environment variables ``JVITALS_COORD`` (``127.0.0.1:PORT``),
``JVITALS_NPROC`` and ``JVITALS_PID`` and calls :func:`init_worker` first. The
launcher picks a free port, kills every worker on any failure or timeout, and
returns each worker's stdout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER_PRELUDE = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=%(devices)d"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, %(repo)r)
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        os.environ["JVITALS_COORD"],
        num_processes=int(os.environ["JVITALS_NPROC"]),
        process_id=int(os.environ["JVITALS_PID"]),
        initialization_timeout=120,
    )
    """
)


def run_workers(body: str, *, nproc: int = 2, devices_per_process: int = 4,
                timeout: float = 240.0, extra_env: dict[str, str] | None = None,
                tmp_path: Path | None = None) -> list[str]:
    """Run ``body`` (Python source) in ``nproc`` processes forming one JAX runtime.

    Args:
      body: the worker's code, run after ``jax.distributed.initialize``.
      nproc: number of processes.
      devices_per_process: forced CPU devices in each process.
      timeout: seconds before every worker is killed and the test fails.
      extra_env: more environment variables for every worker.
      tmp_path: where to write the worker script (a temp dir if None).

    Returns:
      Each worker's stdout, in process order.

    Raises:
      AssertionError: if a worker exits non-zero or the run times out (with every
        worker's output in the message).
    """
    import tempfile

    folder = Path(tmp_path or tempfile.mkdtemp(prefix="jvitals_mp_"))
    script = folder / "worker.py"
    script.write_text(WORKER_PRELUDE % {"devices": devices_per_process, "repo": str(REPO)}
                      + textwrap.dedent(body))
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = [folder / f"worker_{i}.log" for i in range(nproc)]
    try:
        for i in range(nproc):
            env = dict(os.environ)
            env.pop("XLA_FLAGS", None)
            env.update({"JVITALS_COORD": f"127.0.0.1:{port}", "JVITALS_NPROC": str(nproc),
                        "JVITALS_PID": str(i), "TF_CPP_MIN_LOG_LEVEL": "3"})
            env.update(extra_env or {})
            with open(logs[i], "wb") as log:
                procs.append(subprocess.Popen([sys.executable, str(script)], stdout=log,
                                              stderr=subprocess.STDOUT, env=env, cwd=str(folder)))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"workers timed out after {timeout}s:\n" + _dump(logs))
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(0.5)  # let the others print their part of the story
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        if any(c != 0 for c in codes):
            raise AssertionError(f"worker exit codes {codes}:\n" + _dump(logs))
        return [log.read_text() for log in logs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass


def _dump(logs: list[Path]) -> str:
    return "\n".join(f"--- worker {i} ---\n{p.read_text()[-4000:] if p.exists() else ''}"
                     for i, p in enumerate(logs))
