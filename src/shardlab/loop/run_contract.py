"""What `shardlab train` does with a run directory that already exists, decided before any worker
starts (docs/training.md, "Run names and resuming"), from the run's files alone: no worker, no
process group.

[Note: the run contract]
The default run name is a hash of the config (loop/run.py), so the same command names the same
run directory. Then:
- an unfinished run (a complete checkpoint short of train.steps) resumes from its latest
  checkpoint, with no flag: a preempted job, an elastic restart and a Slurm requeue run the
  same command and must continue, not start over;
- a finished run (its latest checkpoint at train.steps and metrics.json recording that step)
  is said in one line and nothing starts, exit 0: a higher train.steps trains on from it,
  `--fresh` starts over;
- `--fresh` trains from step 0 in a new directory beside it, `<name>-2` (then -3, ...), so no
  earlier run's checkpoints are ever replaced; the line it prints names that directory and the
  command that resumes it (`shardlab train <dir>/config.yaml`, which holds the name);
- `checkpoint.resume=none` where complete checkpoints already are, with saves on, would train
  from step 0 and replace or prune them (checkpoint/manager.py's `_prune`): refused, naming
  `--fresh`.
The launcher decides this once, before its workers exist. Under torchrun, srun or a pod the
workers are the first processes: there is no parent to pick a fresh name for all of them (each
rank, and each restart, would pick its own), so `--fresh` is refused there (output.run_name names
a new run), and a finished run is found by the workers after they are built (loop/run.py's
`finished_record`, rank 0's answer for all) and said in the same line (`finished_line`), which
offers another output.run_name there in place of --fresh.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from shardlab.atomic import read_json
from shardlab.checkpoint.format import list_checkpoints
from shardlab.config import Config, ConfigError


def run_directory(cfg: Config) -> str:
    return os.path.join(cfg.output.dir, cfg.output.run_name)


def checkpoint_root(cfg: Config) -> str:
    """Where the run's checkpoints are (checkpoint.dir, else <run dir>/checkpoints: checkpoint/manager.py)."""
    return cfg.checkpoint.dir or os.path.join(run_directory(cfg), "checkpoints")


def finished_metrics(cfg: Config) -> dict[str, Any] | None:
    """metrics.json of a run that reached train.steps: its latest complete checkpoint is at (or past)
    train.steps and metrics.json records that step, as loop/run.py's `finished_record` decides once
    the checkpoint is loaded. None when checkpoint.resume is not auto (nothing is resumed by itself)."""
    if cfg.checkpoint.resume != "auto":
        return None
    found = list_checkpoints(checkpoint_root(cfg))
    if not found or found[-1][0] < cfg.train.steps:
        return None
    metrics = read_json(os.path.join(run_directory(cfg), "metrics.json"))
    return metrics if isinstance(metrics, dict) and metrics.get("steps") == found[-1][0] else None


def finished_line(out_dir: str, step: int, steps: int, launcher: bool = True) -> str:
    """The one line a finished run started again prints: here, before shardlab's launcher starts any
    worker, or by the workers of another launcher (loop/train.py), where --fresh is not offered."""
    over = "--fresh starts over beside it" if launcher else "another output.run_name starts over"
    return (f"shardlab: the run finished at step {step} (train.steps={steps}): nothing to do; its records are kept "
            f"({out_dir}/metrics.json); a higher train.steps trains on, {over}")


def fresh_run_name(cfg: Config) -> str:
    """`<run name>-N`, the lowest N >= 2 whose directory does not exist yet."""
    n = 2
    while os.path.exists(os.path.join(cfg.output.dir, f"{cfg.output.run_name}-{n}")):
        n += 1
    return f"{cfg.output.run_name}-{n}"


def _saves(cfg: Config) -> bool:
    c = cfg.checkpoint
    return c.every_steps > 0 or bool(c.every_seconds) or c.final


def settle(cfg: Config, fresh: bool, launched_worker: bool, elastic: bool) -> int | None:
    """Before any worker starts: the run name (the default one, or the fresh one with `fresh`), then
    None to go on, or the exit code after saying why not ([Note: the run contract])."""
    from shardlab.loop.run import default_run_name  # deferred: the training loop's modules (torch)
    from shardlab.loop.runtime import env_world

    if not cfg.output.run_name:
        cfg.output.run_name = default_run_name(cfg)
    try:
        return _settle(cfg, fresh, launched_worker, elastic)
    except ConfigError as e:
        if env_world()[0] == 0:  # every worker of a launched job stops, one says why
            print(f"error: {e}", file=sys.stderr)
        return 2


def _settle(cfg: Config, fresh: bool, launched_worker: bool, elastic: bool) -> int | None:
    if fresh and (launched_worker or elastic):
        raise ConfigError("--fresh picks one new run directory before the workers start, which needs shardlab's "
                          "launcher on one node (--nproc N without --nnodes); here name a new run: "
                          "output.run_name=NAME")
    if launched_worker or elastic:  # the workers decide, together (loop/run.py's finished_record)
        return None
    if fresh:
        kept = run_directory(cfg)
        cfg.output.run_name = fresh_run_name(cfg)
        if cfg.checkpoint.dir and cfg.checkpoint.resume == "auto" and list_checkpoints(cfg.checkpoint.dir):
            raise ConfigError(f"--fresh: checkpoint.dir={cfg.checkpoint.dir} holds checkpoints, which the new run "
                              "would resume from; choose another checkpoint.dir (or leave it unset)")
        print(f"shardlab: a fresh run in {run_directory(cfg)} ({kept} is kept); "
              f"`shardlab train {run_directory(cfg)}/config.yaml` resumes this one", flush=True)
    done = finished_metrics(cfg)
    if done is not None:
        print(finished_line(run_directory(cfg), done["steps"], cfg.train.steps), flush=True)
        return 0
    if cfg.checkpoint.resume == "none" and _saves(cfg):
        found = list_checkpoints(checkpoint_root(cfg))
        if found:
            raise ConfigError(f"checkpoint.resume=none would train from step 0 over the checkpoints in "
                              f"{checkpoint_root(cfg)} (latest: step {found[-1][0]}) and replace or prune them; "
                              "start over beside them with --fresh, or name another run (output.run_name=NAME)")
    return None
