"""Experiment trackers: what Hugging Face Trainer's report_to gives, to each tracker a run names in
`output.trackers` (docs/observability.md, "Trackers"). Rank 0 writes; loop/measurements.py's
`StepLogger` opens them (`Trackers`) and feeds them each logged step's scalars, and
`RunMeasurements.summary` ends them with metrics.json's figures once it is written.

What each one gets, as transformers' WandbCallback and MLflowCallback give it: the run's name
(its directory's, `output.run_name`; a restart's attempt adds `-attempt<n>`), tags (engine, world
size, model, parameters, device: `RunFacts`), the resolved config with the run's world size and
parameter count, every logged step's scalars, system metrics, and at the end the run's figures
(`summary_figures`: peak memory, tokens/s, ...) and metrics.json itself.

- tensorboard: `<run dir>/tensorboard/` (torch's SummaryWriter), the default;
- wandb: a run under `<run dir>/wandb/`, offline unless `WANDB_MODE` says otherwise; at the end a
  line says where it is and the `wandb sync` command that uploads it. Project `WANDB_PROJECT` or
  "shardlab", grouped by the run's name (its attempts together), `WANDB_TAGS` added to the tags;
  system metrics are wandb's own (every `WANDB__STATS_SAMPLING_INTERVAL` s, default 15);
- mlflow: `MLFLOW_TRACKING_URI` if set, else a file store at `<run dir>/mlruns` (MLflow 3 wants
  `MLFLOW_ALLOW_FILE_STORE=true` for it, which is set unless already set), experiment
  `MLFLOW_EXPERIMENT_NAME` or "shardlab", one MLflow run per attempt; system metrics by MLflow's
  own monitor (psutil; every `MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` s, default 10) unless
  `MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false`.

`output.tensorboard` (the key older configs have) is kept: with `output.trackers` unset, the
trackers are `[tensorboard]` when it is true and none when it is false. Both set and
contradicting each other is an error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any

from shardlab.errors import ConfigError

#: tracker -> (the modules it needs, the packages that install them: pyproject.toml's extra of the
#: same name, which tests/test_observe.py keeps equal to these)
TRACKERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tensorboard": (("tensorboard",), ()),   # a dependency of shardlab itself
    "wandb": (("wandb",), ("wandb>=0.18",)),
    "mlflow": (("mlflow", "psutil"), ("mlflow-skinny>=2.10", "psutil>=5.9")),
}

#: how an attempt ended -> wandb's exit code and MLflow's run status
OUTCOMES = {"finished": (0, "FINISHED"), "failed": (1, "FAILED"), "preempted": (75, "KILLED")}


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
        modules, packages = TRACKERS[n]
        if any(importlib.util.find_spec(m) is None for m in modules):
            raise ConfigError(f"output.trackers names {n}, which is not installed: {install_line(packages)}")
    return list(dict.fromkeys(names))


def install_line(packages: tuple[str, ...]) -> str:
    """The command that installs `packages` into the environment shardlab runs from (`pip install
    'shardlab[wandb]'` would look for shardlab on the package index, not in this checkout)."""
    python = sys.executable or "python"
    shown = os.path.relpath(python) if python.startswith(os.getcwd() + os.sep) else python
    return " ".join([shlex.quote(shown), "-m", "pip", "install", *map(shlex.quote, packages)])


@dataclass(frozen=True)
class RunFacts:
    """What the trackers name, tag and describe a run with."""

    run_dir: str
    name: str                   # the run's: its directory's name (output.run_name)
    attempt: int                # torchelastic's restart count: 0, then one more per restart
    config: dict[str, Any]      # the resolved config, and under "run" its world size, parameters, device
    config_text: str            # the config as config.yaml holds it
    tags: dict[str, str]        # engine, world_size, model, parameters, device

    @classmethod
    def of(cls, run: Any, config_text: str) -> RunFacts:
        """From loop/run.py's `Run` (read by its attributes: nothing here imports the loop)."""
        cfg, rt = run.cfg, run.rt
        about = {"world_size": rt.world_size, "num_parameters": run.num_parameters,
                 "num_trainable_parameters": run.num_trainable, "device": str(rt.device)}
        tags = {"engine": cfg.parallel.strategy, "world_size": str(rt.world_size), "model": cfg.model.name,
                "parameters": _count(run.num_parameters), "device": rt.device.type}
        return cls(run.out_dir, cfg.output.run_name or os.path.basename(run.out_dir), rt.restart_count,
                   {**cfg.to_dict(), "run": about}, config_text, tags)

    @property
    def display_name(self) -> str:
        return self.name if self.attempt == 0 else f"{self.name}-attempt{self.attempt}"


def summary_figures(metrics: dict[str, Any]) -> dict[str, float]:
    """The figures a tracker keeps of the whole run (wandb's summary; MLflow and TensorBoard: metrics at
    the last step), from metrics.json: the figures it lacks (no tokens, MFU under compile) are left out."""
    peaks = metrics.get("peak_memory_bytes") or []
    losses = metrics.get("losses") or []
    figures = {
        "summary/loss": losses[-1] if losses else None,
        "summary/val_loss": metrics.get("val_loss"),
        "summary/tokens_per_s": metrics.get("tokens_per_s"),
        "summary/samples_per_s": metrics.get("samples_per_s"),
        "summary/step_time_median_s": metrics.get("step_time_median_s"),
        "summary/mfu": metrics.get("mfu"),
        "summary/peak_memory_bytes": max(peaks) if peaks else None,   # the fullest rank's
        "summary/wall_clock_s": metrics.get("wall_clock_s"),
        "summary/train_time_s": metrics.get("train_time_s"),
        "summary/steps": metrics.get("steps"),
        "summary/num_parameters": metrics.get("num_parameters"),
    }
    return {k: float(v) for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    def __init__(self, facts: RunFacts):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(facts.run_dir, "tensorboard"))
        self.writer.add_text("config", "```\n" + facts.config_text + "\n```", 0)
        self.writer.add_text("tags", ", ".join(f"{k}: {v}" for k, v in facts.tags.items()), 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def end(self, metrics: dict[str, Any] | None, outcome: str, metrics_path: str | None) -> None:
        if metrics is not None:
            self.log(summary_figures(metrics), int(metrics.get("steps") or 0))
        self.writer.close()


class Wandb:
    def __init__(self, facts: RunFacts):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network: `wandb sync` uploads later
        os.environ.setdefault("WANDB_SILENT", "true")   # its banners would bury the progress bar: end() says where
        own = [t.strip() for t in os.environ.get("WANDB_TAGS", "").split(",") if t.strip()]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardlab"), name=facts.display_name,
                              group=facts.name, job_type="train", dir=facts.run_dir, config=facts.config,
                              tags=[f"{k}:{v}" for k, v in facts.tags.items()] + own, reinit="create_new")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def end(self, metrics: dict[str, Any] | None, outcome: str, metrics_path: str | None) -> None:
        run = self.run
        if metrics is not None:
            run.summary.update(summary_figures(metrics))
        if metrics_path is not None:  # a copy: a later attempt rewrites the run's metrics.json
            kept = shutil.copyfile(metrics_path, os.path.join(run.dir, "metrics.json"))
            run.save(kept, base_path=run.dir, policy="now")
        offline = run.settings.mode in ("offline", "dryrun")
        where = _shown(run.settings.sync_dir)
        run.finish(exit_code=OUTCOMES[outcome][0])
        if offline:
            print(f"wandb: offline run in {where}; to upload it: wandb sync {shlex.quote(where)}", flush=True)


class MLflow:
    def __init__(self, facts: RunFacts):
        import mlflow
        from mlflow.entities import Param

        # MLflow 3 keeps its file store "in maintenance mode" and refuses it unless told: it needs no
        # server and starts at once (a SQLite store builds its tables first: 12 s here, 2026-11-26)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.abspath(os.path.join(facts.run_dir, "mlruns"))
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardlab")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        tags = {**facts.tags, "run": facts.name, "attempt": str(facts.attempt), "run_dir": os.path.abspath(facts.run_dir)}
        self.run_id = self.client.create_run(experiment, run_name=facts.display_name, tags=tags).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(facts.config).items()]
        for i in range(0, len(params), 100):   # MLflow takes at most 100 params in one batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, facts.config_text, "config.yaml")
        self.monitor = _system_monitor(mlflow, self.uri, self.run_id)

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def end(self, metrics: dict[str, Any] | None, outcome: str, metrics_path: str | None) -> None:
        if self.monitor is not None:
            self.monitor.finish()
        if metrics is not None:
            self.log(summary_figures(metrics), int(metrics.get("steps") or 0))
        if metrics_path is not None:
            self.client.log_artifact(self.run_id, metrics_path)
        self.client.set_terminated(self.run_id, OUTCOMES[outcome][1])
        browse = f"; to browse it: mlflow ui --backend-store-uri {self.uri}" if self.uri.startswith("file:") else ""
        print(f"mlflow: run {self.run_id} in {self.uri}{browse}", flush=True)


def _system_monitor(mlflow: Any, uri: str, run_id: str) -> Any:
    """MLflow's system-metrics monitor of the run (a thread sampling CPU, memory, disk, network and,
    where there are, GPUs), unless MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING says false."""
    if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true").strip().lower() in ("false", "0", "no"):
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start and stop lines: noise
    mlflow.set_tracking_uri(uri)  # the monitor logs to the process's tracking URI (older MLflow takes no other)
    monitor = SystemMetricsMonitor(run_id)
    monitor.start()
    return monitor


_CLASSES = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


class Trackers:
    """The trackers of one run on rank 0: `log` each logged step's scalars, `end` them once: with the
    run's metrics.json when it trained to its end, else marked failed or preempted."""

    def __init__(self, names: list[str], run: Any, config_text: str):
        facts = RunFacts.of(run, config_text)
        self.open = [_CLASSES[n](facts) for n in names]

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tracker in self.open:
            tracker.log(scalars, step)

    def end(self, metrics: dict[str, Any] | None = None, outcome: str = "finished",
            metrics_path: str | None = None) -> None:
        trackers, self.open = self.open, []
        for tracker in trackers:
            if outcome == "finished":
                tracker.end(metrics, outcome, metrics_path)
                continue
            try:  # an error is on its way out: a tracker's own must not hide it
                tracker.end(None, outcome, None)
            except Exception as e:
                print(f"warning: {type(tracker).__name__} did not end cleanly: {e}", file=sys.stderr, flush=True)


def _count(n: int) -> str:
    """1234567 -> "1.23M": a parameter count as a tag."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _shown(path: str) -> str:
    """A path as a line shows it: relative to the working directory when under it."""
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    return path


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
