"""The ``jvitals`` console script.

Usage::

    jvitals report LOGDIR --out report.html [--title T] [--phase {start-up,middle,late}]
                   [--total-steps N] [--checkpoint-every 500]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from jvitals.report.guide import PHASES

    parser = argparse.ArgumentParser(prog="jvitals", description="jvitals: a training run's vital signs.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser(
            "report",
            help="write a self-contained HTML report from a run's TensorBoard event files",
            description="Reads every event file under LOGDIR (recursively) and writes one HTML file: "
            "level timeline, a plot per metric family, the alerts with diagnosis and prescription, and "
            "the guide's check-up table for the run's phase.")
    rep.add_argument("logdir", metavar="LOGDIR", help="directory written by a clu MetricWriter")
    rep.add_argument("--out", required=True, metavar="PATH", help="HTML file to write")
    rep.add_argument("--title", default=None, help="report title (default: from LOGDIR)")
    rep.add_argument("--phase", choices=PHASES, default=None,
                     help="check-up phase (default: start-up up to step 1000; late past half of "
                     "--total-steps; else middle)")
    rep.add_argument("--total-steps", type=int, default=None, metavar="N",
                     help="planned number of training steps (decides the late phase)")
    rep.add_argument("--checkpoint-every", type=int, default=500, metavar="N",
                     help="expected checkpoint interval in steps (default 500)")
    return parser


def _missing_report_deps() -> list[str]:
    """The packages of the ``report`` extra that are not installed."""
    import importlib.util

    return [name for name in ("tensorboard", "matplotlib") if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``jvitals`` command line; returns the exit status (0 on success)."""
    args = _parser().parse_args(argv)
    if args.command == "report":
        if not os.path.isdir(args.logdir):
            print(f"jvitals report: expected LOGDIR to be a directory, got {args.logdir!r}", file=sys.stderr)
            return 2
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # tensorboard's reader imports tensorflow
        missing = _missing_report_deps()
        if missing:
            print(f"jvitals report needs {' and '.join(missing)}, which the base install leaves out: "
                  "pip install 'jvitals[report]' (or 'jvitals[tensorboard]', which adds clu's "
                  "TensorBoard writer)", file=sys.stderr)
            return 2
        from jvitals.report.page import build_html
        from jvitals.report.run import read_run

        run = read_run(args.logdir)
        if not run.files:
            print(f"jvitals report: no TensorBoard event files (*tfevents*) under {args.logdir!r}; "
                  "writing an empty report", file=sys.stderr)
        doc = build_html(run, title=args.title, phase=args.phase, total_steps=args.total_steps,
                                checkpoint_every=args.checkpoint_every)
        out = os.path.abspath(args.out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(doc)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
