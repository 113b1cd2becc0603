"""The launcher's side: record how the workers exited, and say what went wrong in a few lines,
the verdict first, in place of torchrun's "rank N failed first" (its first failure is the first
rank to *give up*, usually one that waited for the stuck rank until its collective timed out)
and of every worker's traceback.

`shardlab train --nproc N` knows its run directory. Under `python -m shardlab.torchrun` (the
rendered Slurm and Kubernetes jobs) the agent does not: it names a file in RUN_DIR_NOTE_ENV
and the worker with local rank 0 writes its run directory there when it starts.

The workers' stderr (their tracebacks, `[rankN]:` lines) goes to files through torch's own
LogsSpecs (`worker_logs`): `<run dir>/debug/workers/<launch>_<random>/attempt_<k>/<rank>/stderr.log`,
beside torch's `error.json` (the exception `train.worker_main` records for the agent).
"""

from __future__ import annotations

import glob
import os
import signal
import sys
from typing import Any

from shardlab.atomic import write_json_atomic
from shardlab.doctor import analysis, report
from shardlab.doctor.report import verdict
from shardlab.doctor.worker import EXITS_FILE, RUN_DIR_NOTE_ENV, debug_dir, reads_as_peer_failure

__all__ = ["RUN_DIR_NOTE_ENV", "forget_exits", "record_exits", "print_failure_report", "noted_run_dir", "verdict",
           "worker_logs", "failure_lines"]

WORKER_LOGS = "workers"   # under debug/: torch's per-launch, per-attempt, per-rank stdout/stderr files


def forget_exits(run_dir: str) -> None:
    """A new launch: an earlier launch's exit codes must not be read as this one's."""
    path = os.path.join(debug_dir(run_dir), EXITS_FILE)
    if os.path.exists(path):
        os.remove(path)


def record_exits(run_dir: str, launch: str | None, failures: dict[int, Any]) -> OSError | None:
    """The agent's view of the failed workers (torchrun's ProcessFailure per global rank);
    `launch`: the workers' TORCHELASTIC_RUN_ID (None: unknown, read as this launch's). Best effort:
    on a full disk the launcher still reports; returns the error of a write that failed."""
    ranks = {str(r): {"exitcode": f.exitcode, "pid": f.pid, "timestamp": f.timestamp} for r, f in failures.items()}
    try:
        write_json_atomic(os.path.join(debug_dir(run_dir), EXITS_FILE), {"launch": launch, "ranks": ranks})
    except OSError as e:
        return e
    return None


def print_failure_report(run_dir: str, file=None) -> analysis.Diagnosis:  # noqa: ANN001
    """The whole report (a block per rank) without its verdict line."""
    d = analysis.diagnose(run_dir)
    print(report.format_report(d, with_verdict=False), file=file or sys.stderr, flush=True)
    return d


def worker_logs(run_dir: str, verbose: bool) -> Any:
    """torch's LogsSpecs for a launch: each worker's stderr into a file under debug/workers/,
    and also on this terminal when `verbose` (tee). Stdout (rank 0's progress and summary)
    stays on the terminal."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std

    return DefaultLogsSpecs(log_dir=os.path.join(debug_dir(run_dir), WORKER_LOGS), redirects=Std.ERR,
                            tee=Std.ERR if verbose else Std.NONE)


def attempt_log_dir(run_dir: str, launch: str) -> str | None:
    """The newest attempt's directory of torch's worker logs for `launch` (holding <rank>/stderr.log)."""
    attempts = glob.glob(os.path.join(debug_dir(run_dir), WORKER_LOGS, f"{launch}_*", "attempt_*"))
    return max(attempts, key=os.path.getmtime) if attempts else None


def failure_lines(run_dir: str, d: analysis.Diagnosis | None, failures: dict[int, Any], logs: str | None,
                  restarts: int = 0, disk: list[str] | None = None) -> list[str]:
    """What a launcher prints after its workers failed, in order: the doctor's verdict; the one
    exception that matters; where the tracebacks and the whole report are; and, only when a
    worker was lost (not for a desync or an exception the code raised), how to resume. An error
    the workers raised for the user (a full disk's: checkpoint/space.py) is said in its own words;
    `disk`: the launcher's own lines on a filesystem too full for the workers' records, first."""
    told = report.user_errors(d) if d is not None else []
    if told:  # an error the user can fix, raised on purpose by every rank that failed: its own words
        return [f"error: {message}" for message in told] + [f"shardlab: run directory: {run_dir}"]
    return [*(disk or []), *_failure_lines(run_dir, d, failures, logs, restarts, advise=not disk)]


def _failure_lines(run_dir: str, d: analysis.Diagnosis | None, failures: dict[int, Any], logs: str | None,
                   restarts: int, advise: bool) -> list[str]:
    after = f" (after {restarts} restart(s))" if restarts else ""
    if d is not None and d.kind not in ("no record", "finished", "running"):
        lines = [f"error: {verdict(d)}{after}"]
        lost = report.worker_lost(d)
    else:
        lines = ["error: the run failed" + after + ": " + ", ".join(
            f"rank {r} {_exit_text(f.exitcode)}" for r, f in sorted(failures.items()))]
        lost = any(f.exitcode < 0 and f.exitcode != -signal.SIGTERM for f in failures.values())
    exception = (report.key_exception(d) if d is not None else None) or _torch_exception(failures, logs)
    if exception:
        lines.append(f"error: {exception}")
    where = [f"tracebacks: {logs}/<rank>/stderr.log (--verbose shows them here)"] if logs else []
    if d is not None and d.kind != "no record":
        where.append(f"the whole report: shardlab doctor {run_dir}")
    lines.append("shardlab: " + "; ".join([*where, f"run directory: {run_dir}"]))
    if lost and advise:
        lines.append("shardlab: a worker was lost: the same command resumes from the last complete checkpoint "
                     "(checkpoint.resume=auto); with checkpoint.every_steps and --max-restarts such failures are "
                     "survived unattended")
    return lines


def _exit_text(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _torch_exception(failures: dict[int, Any], logs: str | None) -> str | None:
    """Without the doctor's exit records: a failed worker's exception from torch's error file
    (error.json), else the last line it wrote to stderr; one that is not a lost peer first
    (the one that raised, not those that lost it), then the earliest."""
    found = []
    for rank, f in sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0])):
        message = getattr(f, "message", "") or ""
        if isinstance(message, dict):  # error.json as ErrorHandler.record_exception writes it
            message = message.get("message", "")
        message = str(message).strip()
        if not message or message.startswith(("To enable traceback", "Signal ")):
            message = (_last_line(os.path.join(logs, str(f.local_rank), "stderr.log")) if logs else None) or ""
        if message:
            found.append((reads_as_peer_failure(message), f"rank {rank}: {message.splitlines()[0][:300]}"))
    return min(found, key=lambda x: x[0])[1] if found else None


def _last_line(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 4096))
            tail = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    lines = [line.split("]: ", 1)[1] if line.startswith("[rank") and "]: " in line else line for line in tail]
    lines = [line.strip() for line in lines if line.strip()]
    return lines[-1] if lines else None


def noted_run_dir(note: str) -> str | None:
    try:
        with open(note) as f:
            return f.read().strip() or None
    except OSError:
        return None
