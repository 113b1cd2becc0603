"""The launcher's side: record how the workers exited, and print the diagnosis in place of
"rank N failed first" (torchrun's first failure is the first rank to *give up*, usually one
that waited for the stuck rank until its collective timed out).

`shardlab train --nproc N` knows its run directory. Under `python -m shardlab.torchrun` (the
rendered Slurm and Kubernetes jobs) the agent does not: it names a file in RUN_DIR_NOTE_ENV
and the worker with local rank 0 writes its run directory there when it starts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from shardlab.doctor import analysis, report
from shardlab.doctor.report import verdict
from shardlab.doctor.worker import EXITS_FILE, RUN_DIR_NOTE_ENV, debug_dir

__all__ = ["RUN_DIR_NOTE_ENV", "forget_exits", "record_exits", "print_failure_report", "noted_run_dir", "verdict"]


def forget_exits(run_dir: str) -> None:
    """A new launch: an earlier launch's exit codes must not be read as this one's."""
    path = os.path.join(debug_dir(run_dir), EXITS_FILE)
    if os.path.exists(path):
        os.remove(path)


def record_exits(run_dir: str, launch: str | None, failures: dict[int, Any]) -> None:
    """The agent's view of the failed workers (torchrun's ProcessFailure per global rank);
    `launch`: the workers' TORCHELASTIC_RUN_ID (None: unknown, read as this launch's)."""
    from shardlab.metrics import write_json_atomic

    ranks = {str(r): {"exitcode": f.exitcode, "pid": f.pid, "timestamp": f.timestamp} for r, f in failures.items()}
    write_json_atomic(os.path.join(debug_dir(run_dir), EXITS_FILE), {"launch": launch, "ranks": ranks})


def print_failure_report(run_dir: str, file=None) -> analysis.Diagnosis:  # noqa: ANN001
    """The report without its verdict line: the caller prints that last, after its own advice."""
    d = analysis.diagnose(run_dir)
    print(report.format_report(d, with_verdict=False), file=file or sys.stderr, flush=True)
    return d


def noted_run_dir(note: str) -> str | None:
    try:
        with open(note) as f:
            return f.read().strip() or None
    except OSError:
        return None
