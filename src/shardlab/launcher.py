"""Start N local workers through torchrun's elastic agent (the same machinery as `torchrun`).

The parent validates everything first (config, world size, data paths), writes the
resolved config into the run directory, then asks the agent to run
`python -m shardlab train <run dir>/config.yaml` N times with RANK/WORLD_SIZE/... set.
When a worker dies, the agent stops the others and restarts the group up to
`max_restarts` times; workers resume from their latest complete checkpoint.
"""

from __future__ import annotations

import os
import sys
import uuid

from shardlab.config import Config, dump_config
from shardlab.runtime import free_port


def launch_local(cfg: Config, nproc: int, max_restarts: int = 0, extra_env: dict[str, str] | None = None) -> int:
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
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=f"shardlab-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": int(cfg.parallel.timeout_s)},
        max_restarts=max_restarts, monitor_interval=0.2,
    )
    try:
        elastic_launch(launch, entrypoint=sys.executable)("-m", "shardlab", "train", config_path)
    except ChildFailedError as e:
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
    return 0
