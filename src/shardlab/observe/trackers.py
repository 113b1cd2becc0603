"""Experiment trackers: the same scalars and the resolved config to each one a run names in
`output.trackers` (docs/observability.md). Rank 0 writes; loop/measurements.py's `StepLogger` feeds them.

- tensorboard: `<run dir>/tensorboard/` (torch's SummaryWriter), the default;
- wandb: a run under `<run dir>/wandb/`, offline unless `WANDB_MODE` says otherwise (`wandb sync`
  uploads it later), project `WANDB_PROJECT` or "shardlab", named after the run;
- mlflow: `MLFLOW_TRACKING_URI` if set, else a file store at `<run dir>/mlruns` (MLflow 3 wants
  `MLFLOW_ALLOW_FILE_STORE=true` for it, which is set unless already set), experiment
  `MLFLOW_EXPERIMENT_NAME` or "shardlab", one MLflow run per attempt named after the run.

`output.tensorboard` (the key older configs have) is kept: with `output.trackers` unset, the
trackers are `[tensorboard]` when it is true and none when it is false. Both set and
contradicting each other is an error.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from shardlab.errors import ConfigError

#: tracker -> (the module it needs, the extra that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "shardlab"),   # a dependency of shardlab itself
    "wandb": ("wandb", "shardlab[wandb]"),
    "mlflow": ("mlflow", "shardlab[mlflow]"),
}


def resolve_trackers(output: Any) -> list[str]:
    """The trackers a run writes to, from `output.trackers` and `output.tensorboard`; checks
    that each is known and installed (ConfigError, one line, before any worker starts)."""
    names = output.trackers
    if names is None:
        return ["tensorboard"] if output.tensorboard else []
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"output.trackers must be a list of tracker names ({', '.join(TRACKERS)}), got {names!r}")
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"output.trackers: unknown tracker(s) {unknown}; valid: {', '.join(TRACKERS)}")
    if not output.tensorboard and "tensorboard" in names:
        raise ConfigError("output.tensorboard=false contradicts output.trackers, which names tensorboard: drop one")
    for n in names:
        module, extra = TRACKERS[n]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"output.trackers names {n}, which is not installed: pip install '{extra}'")
    return list(dict.fromkeys(names))


class TensorBoard:
    def __init__(self, run_dir: str, run_name: str, config: dict[str, Any], config_text: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self.writer.add_text("config", "```\n" + config_text + "\n```", 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, run_dir: str, run_name: str, config: dict[str, Any], config_text: str):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network: `wandb sync` uploads later
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardlab"), name=run_name, dir=run_dir,
                              config=config, reinit="create_new")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, run_dir: str, run_name: str, config: dict[str, Any], config_text: str):
        import mlflow

        # MLflow 3 keeps its file store "in maintenance mode" and refuses it unless told: it needs no
        # server and starts at once (a SQLite store builds its tables first: 12 s here, 2026-11-26)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.abspath(os.path.join(run_dir, "mlruns"))
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardlab")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=run_name).info.run_id
        from mlflow.entities import Param

        flat = _flatten(config)
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])
        self.client.log_text(self.run_id, config_text, "config.yaml")

    def log(self, scalars: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_CLASSES = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


def open_trackers(names: list[str], run_dir: str, run_name: str, config: dict[str, Any], config_text: str) -> list:
    return [_CLASSES[n](run_dir, run_name, config, config_text) for n in names]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
