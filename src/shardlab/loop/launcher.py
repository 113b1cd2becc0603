"""Start N local workers through torchrun's elastic agent (the same machinery as `torchrun`).

The parent validates everything first (config, world size, data paths), writes the
resolved config into the run directory, then asks the agent to run
`python -m shardlab train <run dir>/config.yaml` N times with RANK/WORLD_SIZE/... set.
When a worker dies, the agent stops the others and restarts the group up to
`max_restarts` times; workers resume from their latest complete checkpoint.

Preemption (docs/preemption.md): SIGTERM or SIGUSR1 to this process is forwarded by the
agent to the workers, which save at the next step boundary; the agent waits up to the
preemption grace period for them, and this process then exits 75 (PREEMPTED_EXIT_CODE).

The workers' stderr goes to files under <run dir>/debug/workers/ (torch's LogsSpecs: their
tracebacks, one per rank, would otherwise bury the diagnosis), and also to the terminal with
`--verbose`; their stdout (rank 0's progress and summary) comes here. After a run that ended
well, what they wrote to stderr (warnings) is shown once, lines repeated by ranks said once.

A failure: the agent stops the other workers (SIGTERM, then SIGKILL after 30 s: torch's agent
waits that long on a failure whatever its shutdown timeout, e.g. for a SIGSTOPped worker) and
this process prints, in a few lines, the hang doctor's verdict from <run dir>/debug/
(docs/debugging.md: which rank is stuck or crashed and where the others waited), the one
exception that matters, and where the rest is (doctor/agent.py, `failure_lines`). torchrun's
"first failure" is the first rank to give up, which is usually one that waited, so it is not
what we report.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from shardlab.atomic import disk_full_errno, read_json
from shardlab.config import Config, dump_config
from shardlab.doctor import agent as doctor
from shardlab.loop import elastic, listen, preemption
from shardlab.loop.runtime import free_port

_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _AgentNoise(logging.Filter):
    """Drops the agent's "failed (exitcode: 1) local_rank: 0 ...": it names the first worker
    to exit, usually one that waited for the stuck one until its collective timed out. The
    doctor's verdict, printed instead, says which rank was stuck. Without --verbose also its
    notes on stopping the survivors (SIGTERM, then SIGKILL): the verdict marks those ranks."""

    def __init__(self, verbose: bool):
        super().__init__()
        self.dropped = ("failed (exitcode",) + (() if verbose else ("Sending process", "Unable to shutdown"))

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.dropped)


@dataclass(frozen=True)
class Rendezvous:
    """Where the agents of one job meet: one agent with its own store (launch_local's default),
    or MIN..MAX agents at a shared c10d endpoint (launch_elastic)."""

    min_nodes: int = 1
    max_nodes: int = 1
    endpoint: str | None = None   # None: a free port on loopback
    run_id: str | None = None     # None: a fresh random id (one agent: nothing to agree on)


def launch_elastic(cfg: Config, nproc: int, nodes: tuple[int, int], endpoint: str, rdzv_id: str | None,
                   max_restarts: int, verbose: bool = False) -> int:
    """One agent (node) of an elastic job of MIN..MAX agents with `nproc` workers each, meeting
    at `endpoint` (docs/elastic.md). A restart re-forms the group at whatever agents are left or
    have joined; the workers resume from the latest checkpoint at the same global batch."""
    return launch_local(cfg, nproc, max_restarts, elastic.AGENT_ENV, verbose=verbose,
                        rdzv=Rendezvous(nodes[0], nodes[1], endpoint, elastic.require_rdzv_id(rdzv_id, nodes)))


def launch_local(cfg: Config, nproc: int, max_restarts: int = 0, extra_env: dict[str, str] | None = None,
                 verbose: bool = False, rdzv: Rendezvous = Rendezvous()) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    out = os.path.join(cfg.output.dir, cfg.output.run_name)
    config_path = _write_config(cfg, out)
    if config_path is None:
        return 1
    # One thread per worker unless the user says otherwise: N workers on N cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.update(extra_env or {})
    marker = preemption.new_marker()
    os.environ[preemption.MARKER_ENV] = marker
    grace = preemption.grace_estimate(cfg) if cfg.preemption.enabled else None
    doctor.forget_exits(out)
    run_id = rdzv.run_id or f"shardlab-{uuid.uuid4().hex[:8]}"  # the workers' TORCHELASTIC_RUN_ID: the doctor's
    # launch id; how to resume this run, whatever command started it (--fresh names a new one: run_contract.py)
    again = (f"`shardlab train {config_path} --nproc {nproc}` resumes from it" if rdzv.max_nodes == 1
             else "The same command resumes from it") + f". Run directory: {out}"
    # until the agent installs its handlers (when the workers start), SIGUSR1 must not kill us
    previous = signal.signal(signal.SIGUSR1, preemption.raise_in_agent) if grace else None
    quiet = _AgentNoise(verbose or not cfg.doctor.enabled)
    logging.getLogger(_AGENT_LOGGER).addFilter(quiet)
    try:
        launch = _launch_config(cfg, nproc, max_restarts, rdzv, run_id, grace, out, verbose)
        elastic_launch(launch, entrypoint=sys.executable)("-m", "shardlab", "train", config_path)
    except SignalException as e:
        return _stopped(e, marker, out, again)
    except ChildFailedError as e:
        if preemption.agent_exit_code(e, marker) == preemption.PREEMPTED_EXIT_CODE:
            print(f"shardlab: the workers were signalled and saved a preemption checkpoint; exit code "
                  f"{preemption.PREEMPTED_EXIT_CODE}. {again}", file=sys.stderr)
            return preemption.PREEMPTED_EXIT_CODE
        _report_failure(out, run_id, e, max_restarts, cfg, verbose, alone=rdzv.max_nodes == 1)
        return 1
    finally:
        logging.getLogger(_AGENT_LOGGER).removeFilter(quiet)
        if previous is not None:
            signal.signal(signal.SIGUSR1, previous)
        if os.path.exists(marker):
            os.remove(marker)
    if not verbose:
        _show_worker_warnings(doctor.attempt_log_dir(out, run_id), nproc)
    return 0


def _write_config(cfg: Config, out: str) -> str | None:
    """<run dir>/config.yaml, the file every worker trains from; None (said) when the run directory
    cannot be written at all, before any worker starts."""
    config_path = os.path.join(out, "config.yaml")
    try:
        os.makedirs(out, exist_ok=True)
        with open(config_path, "w") as f:
            f.write(dump_config(cfg))
    except OSError as e:
        free = shutil.disk_usage(cfg.output.dir).free if os.path.isdir(cfg.output.dir) else None
        print(f"error: cannot write the run directory {out}: {e.strerror or e}"
              + (f" ({free / 2**20:.1f} MiB free there); free space or choose output.dir on another filesystem"
                 if free is not None and disk_full_errno(e) else "; check output.dir"), file=sys.stderr)
        return None
    return config_path


def _launch_config(cfg: Config, nproc: int, max_restarts: int, rdzv: Rendezvous, run_id: str,
                   grace: Any, out: str, verbose: bool) -> Any:
    """torch's LaunchConfig for the agent: the rendezvous, restarts, the signals it forwards and
    how long it waits for the workers after one (the preemption grace), the workers' log files."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    # torch before 2.13 (a GPU image's build) has no shutdown_timeout: its agent waits its own default
    waits = ({"shutdown_timeout": grace.grace_s if grace else 30}
             if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {})
    return LaunchConfig(
        min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes, nproc_per_node=nproc,
        run_id=run_id,
        # torch's c10d rendezvous with its stores bound to one address ([Note: who may reach a run's
        # stores] in loop/listen.py): loopback here, the endpoint's side for a multi-host job
        rdzv_backend=listen.register_rendezvous(), rdzv_endpoint=rdzv.endpoint or f"{listen.LOOPBACK}:{free_port()}",
        rdzv_configs={"timeout": int(cfg.parallel.timeout_s),  # [Note: the last call] (loop/elastic.py)
                      **elastic.rendezvous_timeouts()},
        max_restarts=max_restarts, monitor_interval=0.2,
        # the agent forwards these to the workers; on one it waits shutdown_timeout, then SIGKILL
        signals_to_handle=preemption.AGENT_SIGNALS if grace else "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        **waits,
        logs_specs=doctor.worker_logs(out, verbose),
    )


def _stopped(e: Any, marker: str, out: str, again: str) -> int:
    """This process was signalled (SIGTERM, SIGUSR1, ...): the workers' preemption save, if they
    made one, in one line; the exit code (75 after a save)."""
    code = preemption.agent_exit_code(e, marker)
    record = read_json(marker)
    if record is not None:
        print(f"shardlab: preempted by {record['signal']}: checkpoint of step {record['step']} saved in "
              f"{record['save_seconds']:.2f} s ({record['checkpoint']}); exit code {code}. {again}", file=sys.stderr)
    else:
        print(f"error: stopped by {e.sigval.name} before the workers saved a checkpoint (exit code {code}). "
              f"Run directory: {out}", file=sys.stderr)
    return code


def _report_failure(out: str, run_id: str, e: Exception, max_restarts: int, cfg: Config, verbose: bool,
                    alone: bool) -> None:
    """A few lines, the verdict first (doctor/agent.py, `failure_lines`); with --verbose the
    doctor's whole report (a block per rank) before them. A filesystem too full for the workers'
    records is said first (checkpoint/space.py; `alone`: no other agent's workers may still write)."""
    from shardlab.checkpoint.space import full_filesystem_lines  # deferred: torch's DCP, for a failure only

    d = write_error = None
    if cfg.doctor.enabled:
        write_error = doctor.record_exits(out, run_id, e.failures)  # best effort: None once written
        d = doctor.print_failure_report(out) if verbose else doctor.analysis.diagnose(out)
    try:
        disk = full_filesystem_lines(out, cfg.checkpoint.dir or os.path.join(out, "checkpoints"), write_error, alone)
    except OSError:
        disk = []
    lines = doctor.failure_lines(out, d, e.failures, doctor.attempt_log_dir(out, run_id), max_restarts, disk)
    sys.stderr.write("".join(f"{line}\n" for line in lines))  # one write: nothing interleaves with it
    sys.stderr.flush()


# a tqdm frame ("Writing model shards:  40%|####      | 2/5 [00:01<00:01, ...]"): reading the file splits
# a bar's frames at its carriage returns; some library's bar left on is progress, not a warning
_BAR_FRAME = re.compile(r"\d+%\|.*\| *\d+/\S* \[")
# what makes one rank's copy of a line differ from another's: torch's "[rank1]:" prefix, and the
# clock and pid of its log header ("W1128 00:32:11.868000 1849 "), kept as its severity letter
_RANK_HEADER = re.compile(r"^\[rank\d+\]:(?:([WEIDC])\d{4} [\d:.]+ +\d+ )?")


def _show_worker_warnings(logs: str | None, nproc: int, limit: int = 20) -> None:
    """After a run that ended well: what the workers wrote to stderr (warnings) but progress bars'
    frames, each line once however many ranks wrote it (their rank prefixes and clocks aside), at
    most `limit` lines."""
    seen: dict[str, None] = {}
    for rank in range(nproc):
        try:
            with open(os.path.join(logs or "", str(rank), "stderr.log"), errors="replace") as f:
                seen.update(dict.fromkeys(_RANK_HEADER.sub(lambda m: f"{m[1]} " if m[1] else "", line.rstrip())
                                          for line in f if line.strip() and not _BAR_FRAME.search(line)))
        except OSError:
            continue
    lines = list(seen)
    for line in lines[:limit]:
        print(line, file=sys.stderr)
    if len(lines) > limit:
        print(f"shardlab: {len(lines) - limit} more line(s) the workers wrote to stderr: {logs}/<rank>/stderr.log",
              file=sys.stderr)
