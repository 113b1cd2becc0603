"""Start N local workers through torchrun's elastic agent (the same machinery as `torchrun`).

The parent validates everything first (config, world size, data paths), writes the
resolved config into the run directory, then asks the agent to run
`python -m shardlab train <run dir>/config.yaml` N times with RANK/WORLD_SIZE/... set.
When a worker dies, the agent stops the others and restarts the group up to
`max_restarts` times; workers resume from their latest complete checkpoint.

Preemption (docs/preemption.md): SIGTERM or SIGUSR1 to this process is forwarded by the
agent to the workers, which save at the next step boundary; the agent waits up to the
preemption grace period for them, and this process then exits 75 (PREEMPTED_EXIT_CODE).
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

from shardlab import preemption
from shardlab.config import Config, dump_config
from shardlab.runtime import free_port


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
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=f"shardlab-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": int(cfg.parallel.timeout_s)},
        max_restarts=max_restarts, monitor_interval=0.2,
        # the agent forwards these to the workers; on one it waits shutdown_timeout, then SIGKILL
        signals_to_handle=preemption.AGENT_SIGNALS if grace else "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        shutdown_timeout=grace.grace_s if grace else 30,
    )
    # until the agent installs its handlers (when the workers start), SIGUSR1 must not kill us
    previous = signal.signal(signal.SIGUSR1, preemption.raise_in_agent) if grace else None
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
        first_rank, first = e.get_first_failure()
        how = (f"killed by signal {-first.exitcode}" if first.exitcode < 0 else f"exit code {first.exitcode}")
        others = sorted(r for r in e.failures if r != first_rank)
        print(f"error: rank {first_rank} failed first ({how})"
              + (f"; then ranks {others}" if others else "")
              + (f", after {max_restarts} restart(s)" if max_restarts else "")
              + f". Its message is above. Run directory: {out}. If a worker was lost (killed, out of memory, "
              f"a failed node), the same command resumes from the last complete checkpoint "
              f"(checkpoint.resume=auto); with checkpoint.every_steps and --max-restarts such failures "
              f"are survived unattended.", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGUSR1, previous)
        if os.path.exists(marker):
            os.remove(marker)
    return 0
