"""Start N local workers through torchrun's elastic agent (the same machinery as `torchrun`).

The parent validates everything first (config, world size, data paths), writes the
resolved config into the run directory, then asks the agent to run
`python -m shardlab train <run dir>/config.yaml` N times with RANK/WORLD_SIZE/... set.
When a worker dies, the agent stops the others and restarts the group up to
`max_restarts` times; workers resume from their latest complete checkpoint.

Preemption (docs/preemption.md): SIGTERM or SIGUSR1 to this process is forwarded by the
agent to the workers, which save at the next step boundary; the agent waits up to the
preemption grace period for them, and this process then exits 75 (PREEMPTED_EXIT_CODE).

A failure: the agent stops the other workers (SIGTERM, then SIGKILL after 30 s: torch's agent
waits that long on a failure whatever its shutdown timeout, e.g. for a SIGSTOPped worker) and
this process prints the hang doctor's diagnosis from <run dir>/debug/ (docs/debugging.md):
which rank is stuck or crashed and where the others waited. torchrun's "first failure" is the
first rank to give up, which is usually one that waited, so it is not what we report.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid

from shardlab import preemption
from shardlab.config import Config, dump_config
from shardlab.doctor import agent as doctor
from shardlab.runtime import free_port

_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _NoFirstFailureLine(logging.Filter):
    """Drops the agent's "failed (exitcode: 1) local_rank: 0 ...": it names the first worker
    to exit, usually one that waited for the stuck one until its collective timed out. The
    doctor's report, printed instead, says which rank was stuck."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def launch_local(cfg: Config, nproc: int, max_restarts: int = 0, extra_env: dict[str, str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    out = os.path.join(cfg.output.dir, cfg.output.run_name)
    os.makedirs(out, exist_ok=True)
    config_path = os.path.join(out, "config.yaml")
    with open(config_path, "w") as f:
        f.write(dump_config(cfg))
    # One thread per worker unless the user says otherwise: N workers on N cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.update(extra_env or {})
    marker = preemption.new_marker()
    os.environ[preemption.MARKER_ENV] = marker
    grace = preemption.grace_estimate(cfg) if cfg.preemption.enabled else None
    doctor.forget_exits(out)
    run_id = f"shardlab-{uuid.uuid4().hex[:8]}"  # the workers' TORCHELASTIC_RUN_ID: the doctor's launch id
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": int(cfg.parallel.timeout_s)},
        max_restarts=max_restarts, monitor_interval=0.2,
        # the agent forwards these to the workers; on one it waits shutdown_timeout, then SIGKILL
        signals_to_handle=preemption.AGENT_SIGNALS if grace else "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        shutdown_timeout=grace.grace_s if grace else 30,
    )
    # until the agent installs its handlers (when the workers start), SIGUSR1 must not kill us
    previous = signal.signal(signal.SIGUSR1, preemption.raise_in_agent) if grace else None
    quiet = _NoFirstFailureLine() if cfg.doctor.enabled else None
    if quiet is not None:
        logging.getLogger(_AGENT_LOGGER).addFilter(quiet)
    try:
        elastic_launch(launch, entrypoint=sys.executable)("-m", "shardlab", "train", config_path)
    except SignalException as e:
        code = preemption.agent_exit_code(e, marker)
        record = preemption.read_marker(marker)
        if record is not None:
            print(f"shardlab: preempted by {record['signal']}: checkpoint of step {record['step']} saved in "
                  f"{record['save_seconds']:.2f} s ({record['checkpoint']}); exit code {code}. The same command "
                  f"resumes from it. Run directory: {out}", file=sys.stderr)
        else:
            print(f"error: stopped by {e.sigval.name} before the workers saved a checkpoint (exit code {code}). "
                  f"Run directory: {out}", file=sys.stderr)
        return code
    except ChildFailedError as e:
        if preemption.agent_exit_code(e, marker) == preemption.PREEMPTED_EXIT_CODE:
            print(f"shardlab: the workers were signalled and saved a preemption checkpoint; exit code "
                  f"{preemption.PREEMPTED_EXIT_CODE}. The same command resumes from it. Run directory: {out}",
                  file=sys.stderr)
            return preemption.PREEMPTED_EXIT_CODE
        _report_failure(out, run_id, e, max_restarts, cfg.doctor.enabled)
        return 1
    finally:
        if quiet is not None:
            logging.getLogger(_AGENT_LOGGER).removeFilter(quiet)
        if previous is not None:
            signal.signal(signal.SIGUSR1, previous)
        if os.path.exists(marker):
            os.remove(marker)
    return 0


def _report_failure(out: str, run_id: str, e: Exception, max_restarts: int, doctor_enabled: bool) -> None:
    """The doctor's diagnosis, then what to do, then its verdict (the stuck or crashed rank) last."""
    d = None
    if doctor_enabled:
        doctor.record_exits(out, run_id, e.failures)
        d = doctor.print_failure_report(out)
    exits = "" if d is not None else " (" + ", ".join(
        f"rank {r}: " + (f"killed by signal {-f.exitcode}" if f.exitcode < 0 else f"exit code {f.exitcode}")
        for r, f in sorted(e.failures.items())) + ")"
    print(f"error: the run failed{exits}" + (f" after {max_restarts} restart(s)" if max_restarts else "")
          + f". Run directory: {out}" + (f"; this report again: shardlab doctor {out}" if d is not None else "")
          + ". If a worker was lost (killed, out of memory, a failed node), the same command resumes from the "
          "last complete checkpoint (checkpoint.resume=auto); with checkpoint.every_steps and --max-restarts such "
          "failures are survived unattended.", file=sys.stderr)
    if d is not None:
        print(f"error: {doctor.verdict(d)}", file=sys.stderr, flush=True)
