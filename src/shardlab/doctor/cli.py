"""`shardlab doctor RUN_DIR [--live]`: read <run dir>/debug/ and say which rank is stuck and
where every rank waits (docs/debugging.md).

  shardlab doctor runs/gpt-fsdp-...            after the fact (a crash, a timeout, a copy of a
                                               cluster's run directory): the diagnosis
  shardlab doctor runs/gpt-fsdp-... --live     while it runs: asks every running rank for its
                                               stacks, then each rank's step, phase and
                                               collective, and who waits for whom right now
Exit code: 0 nothing wrong found (finished, or running without a long wait), 1 a problem
diagnosed, 2 no record to read.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="diagnose a hung or failed run: the stuck rank and where every rank waits",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (<output.dir>/<output.run_name>)")
    p.add_argument("--live", action="store_true",
                   help="the run is going: ask the running ranks for their stacks, then show each rank's state now")
    p.add_argument("--wait", type=float, default=3.0, metavar="S",
                   help="with --live: seconds to wait for the ranks' stack dumps (default 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardlab.doctor import analysis, report, worker

    debug = worker.debug_dir(args.run_dir)
    if not os.path.isdir(debug):
        what = "is not a directory" if not os.path.isdir(args.run_dir) else "has no debug/ folder"
        print(f"error: {args.run_dir} {what}: give the run directory of a shardlab run "
              "(<output.dir>/<output.run_name>), which holds debug/ with each rank's flight record",
              file=sys.stderr)
        return 2
    if args.live:
        _request_and_wait(args.run_dir, args.wait)
    d = analysis.diagnose(args.run_dir, live=args.live)
    if args.live and d.ranks:
        print(report.live_table(d))
        print()
    print(report.format_report(d))
    if d.kind == "no record":
        return 2
    return 0 if d.kind in ("finished", "running") else 1


def _request_and_wait(run_dir: str, wait_s: float) -> None:
    """Ask for stacks; wait until every rank still running has answered, or `wait_s` passed."""
    from shardlab.doctor import analysis, worker

    request = worker.request_dump(worker.debug_dir(run_dir), "shardlab doctor --live", f"pid {os.getpid()}")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        ranks = analysis.load(run_dir)
        now = time.time()
        pending = [r for r, v in ranks.items() if v.flight is not None and v.flight.state == "running"
                   and now - v.flight.tick < analysis.NOT_RUNNING_AFTER_S and v.flight.answered < request]
        if not pending:
            return
        time.sleep(0.1)
