"""What one worker trains with, built once (`build_run`) and then driven step by step by the loop
(train.py): the model behind its engine, the optimizer, the LR schedule, the loss scaler, the data
and its step-indexed sampler, the checkpoint manager and the state a resume restores (`Run`,
`TrainState`); its saves and what each one costs (`CheckpointCost`); where the run lives
(`run_dir`, `default_run_name`), what it writes and says before its first step (`write_start`),
and the runtime a worker starts it in.

What each checkpoint costs, on the record: when a save is due, how long training was held up by
it, how long the write took, how many bytes at what speed. One line per save (rank 0), once the
checkpoint is committed:
  shardlab: checkpoint step 8: 12.3 MiB, training held up 0.04 s, written in 0.31 s (0.04 GB/s)
and the same figures in metrics.json (`checkpoint_saves`, `checkpoint_blocking_s`,
`checkpoint_write_s`) with totals and their share of the wall clock in the run's summary.

[Note: held up versus written]
"Held up" is the time the training loop spent inside the save call on rank 0: for a
synchronous save the whole save (DCP's write, hashing, commit); for `checkpoint.async=true`
only the copy of the state (staging) and DCP's planning, the write and commit running in the
background. "Written" is from the call to the commit (the manifest's save_seconds, measured
by the checkpoint manager), so for an async save it includes the steps that trained meanwhile.
Bytes are the committed files' sizes as the manifest lists them; GB/s is bytes / written.
Rank 0's clock stands for all: the ranks leave a save together (its last act is a collective
agreement), so their held-up times differ by scheduling noise only.

`checkpoint.every_seconds` saves when that many seconds passed since the last save (or the
start), besides `every_steps`. Clocks differ per rank and every rank must save together, so
rank 0's clock decides and one tiny broadcast per step carries its answer (only when
every_seconds is set).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardlab
from shardlab import memory
from shardlab.atomic import read_json, write_json_atomic
from shardlab.config import (
    Config,
    OutputConfig,
    ParallelConfig,
    dump_config,
    engine_options,
    validate_for_world,
)
from shardlab.data import GlobalBatchSampler, build_datasets, make_sampler
from shardlab.data.loader import Layout, StepBatches, layout_for
from shardlab.data.text import copy_tokenizer_files
from shardlab.doctor import worker as doctor
from shardlab.engines import Engine, engine_class, engine_of
from shardlab.loop import elastic
from shardlab.loop.evaluate import Evaluation, evaluate_sources
from shardlab.loop.loss import make_loss_scaler
from shardlab.loop.runtime import Runtime, all_gather_object, hostname, init_runtime, seed_everything
from shardlab.loop.schedule import make_optimizer, make_schedule, schedule_note
from shardlab.models import build_model, count_parameters
from shardlab.sync_batchnorm import convert_sync_batchnorm


@dataclass
class TrainState:
    """Everything besides model and optimizer that a resume must restore. The data position
    is the step: the sampler's batch for step s is a pure function of (seed, s).
    loss_scaler: the fp16 scaler's state (None without fp16), so a resume is exact.
    data_manifest: the SHA-256 of the prepared corpus's manifest (None for other sources); a
    resume on another corpus is refused, as its step would index other data."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    loss_scaler: dict[str, Any] | None = None
    data_manifest: str | None = None

    def advance(self, result: Any) -> None:
        """One more step trained (train.StepResult): its loss, and whether an fp16 overflow skipped it."""
        self.step += 1
        self.losses.append(result.loss)
        self.skipped_steps += result.skipped


class Finished(dict):
    """metrics.json of a run that had reached its last step when this group started: what `train`
    returns then, with nothing trained and nothing rewritten ([Note: records stay true] in run_summary.py)."""


@dataclass
class Run:
    """What one worker trains with: built once, then driven step by step."""

    cfg: Config
    rt: Runtime
    out_dir: str
    data: Any
    model: nn.Module
    engine: Engine
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    sampler: GlobalBatchSampler  # or a source's own with its interface (data.make_sampler: a mixture's)
    manager: Any
    state: TrainState
    accumulation: int
    num_parameters: int
    num_trainable: int                # parameters with requires_grad (LoRA: the adapters)
    resumed_from: str | None = None   # the checkpoint this run resumed from
    batches: StepBatches | None = None  # this rank's micro batches, step by step (data/loader.py)
    cost: CheckpointCost | None = None  # when saves are due and what each cost (`CheckpointCost`, below)
    layout: Layout | None = None      # micro batch and accumulation at this world size (data/loader.py)
    change: elastic.Change | None = None  # an elastic group's change since the last start (its line: StepLogger)
    finished: Finished | None = None  # the run had reached its last step: its metrics.json, kept as it is

    def eval_due(self) -> bool:
        """train.eval_every: a validation loss at this step (the last step's comes after the final save)."""
        t, step = self.cfg.train, self.state.step
        return bool(t.eval_every) and step % t.eval_every == 0 and step < t.steps

    def evaluate(self) -> Evaluation:
        """The validation loss now (evaluate.py), every rank taking its share; a mixture's per corpus too."""
        with memory.phase_range("eval"):
            return evaluate_sources(self.model, self.data.val, self.cfg.train, self.rt)

    def save_if_due(self, final: bool = False) -> None:
        """The checkpoint due at this step (checkpoint.every_steps, every_seconds), or with final the
        last one; each save timed and its line printed once committed (`CheckpointCost`, below)."""
        if self.manager is None:
            return
        with self._saving() as m:
            step, args, cost = self.state.step, (self.model, self.opt, self.sched, self.state), self.cost
            if final and m.final_due(step):
                cost.timed(step, lambda: m.finalize(*args))
            elif final:
                m.finalize(*args)  # nothing to write: an async save in flight is committed
            elif m.due(step):
                cost.timed(step, lambda: m.maybe_save(*args))
            elif step != m.last_saved_step and cost.seconds_due():  # every_seconds, by rank 0's clock
                m.refuse_non_finite(self.model, step)
                cost.timed(step, lambda: m.save(*args))
            cost.report()  # an async save committed since

    def save_now(self) -> str:
        """A synchronous checkpoint of the current step (a preemption's), unless that step is
        saved already; any in-flight asynchronous save is committed first."""
        from shardlab.checkpoint import step_dir_name

        with self._saving() as m:
            if m.last_saved_step != self.state.step:
                m.refuse_non_finite(self.model, self.state.step)
                self.cost.timed(self.state.step, lambda: m.save(self.model, self.opt, self.sched, self.state,
                                                                blocking=True))
            m.wait()
            self.cost.report()
        return os.path.join(m.root, step_dir_name(self.state.step))

    @contextlib.contextmanager
    def _saving(self) -> Iterator[Any]:
        if self.scaler is not None:  # a resume is exact only with the fp16 scaler's state
            self.state.loss_scaler = self.scaler.state_dict()
        with memory.phase_range("checkpoint"):
            yield self.manager

    def export(self) -> None:
        """export.format=hf: the Hugging Face directory at the end of training (every rank gathers,
        rank 0 writes: export_hf.py)."""
        if self.cfg.export.format == "hf":
            from shardlab.export_hf import export_at_end  # deferred: only runs that export need it

            export_at_end(self)


# -- what each save costs --------------------------------------------------------------------------
class CheckpointCost:
    """Decides when `every_seconds` makes a save due (`every_steps` is the manager's rule) and records what each save cost."""

    def __init__(self, root: str, rt: Any, every_seconds: float | None = None):
        self.root, self.rt, self.every_seconds = root, rt, every_seconds
        self.last_time = time.monotonic()
        self.saves: list[dict[str, Any]] = []        # committed saves, as metrics.json lists them
        self._held: dict[int, float] = {}           # step -> seconds held up, until its commit is seen

    def seconds_due(self) -> bool:
        """checkpoint.every_seconds passed since the last save (or the start), by rank 0's clock. Every
        rank calls it at the same step boundaries (a collective when every_seconds is set)."""
        if not self.every_seconds:
            return False
        flag = torch.tensor([float(time.monotonic() - self.last_time >= self.every_seconds)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(flag, 0)  # rank 0's clock decides (see the module's docstring)
        return bool(flag.item())

    def timed(self, step: int, save) -> Any:
        """Run `save()` (the manager's), recording how long it held training up."""
        t0 = time.perf_counter()
        out = save()
        self._held[step] = time.perf_counter() - t0
        self.last_time = time.monotonic()
        self.report()
        return out

    def report(self) -> None:
        """Rank 0: a line and a record for each save committed since the last call (an async one
        commits in the background: it shows at a later step boundary or at the end)."""
        from shardlab.checkpoint.format import (  # deferred: shardlab.checkpoint imports torch.distributed.checkpoint
            MANIFEST,
            step_dir_name,
        )

        for step in sorted(self._held):
            path = os.path.join(self.root, step_dir_name(step), MANIFEST)
            if not os.path.exists(path):
                continue
            held = self._held.pop(step)
            if not self.rt.is_main:
                continue
            with open(path) as f:
                manifest = json.load(f)
            size = sum(manifest.get("files", {}).values())
            write = float(manifest.get("save_seconds") or held)
            record = {"step": step, "bytes": size, "blocking_s": held, "write_s": write,
                      "gb_s": size / write / 1e9 if write > 0 else None}
            self.saves.append(record)
            print(save_line(record), flush=True)

    def summary(self, wall_s: float) -> dict[str, Any]:
        """metrics.json's checkpoint figures (rank 0's)."""
        blocking = [s["blocking_s"] for s in self.saves]
        write = [s["write_s"] for s in self.saves]
        return {"checkpoint_saves": self.saves, "checkpoint_blocking_s": blocking, "checkpoint_write_s": write,
                "checkpoint_blocking_total_s": sum(blocking), "checkpoint_write_total_s": sum(write),
                "checkpoint_blocking_fraction": sum(blocking) / wall_s if wall_s > 0 else None}


def save_line(r: dict[str, Any]) -> str:
    """A committed save's line (the module's docstring shows one)."""
    speed = f"{r['gb_s']:.2f} GB/s" if r["gb_s"] is not None else "-"
    return (f"shardlab: checkpoint step {r['step']}: {r['bytes'] / 2**20:.1f} MiB, training held up "
            f"{r['blocking_s']:.2f} s, written in {r['write_s']:.2f} s ({speed})")


# -- building the run -------------------------------------------------------------------------------
def build_run(cfg: Config, rt: Runtime, *, data: Any = None,
              adapt_model: Callable[[nn.Module], nn.Module] | None = None) -> Run:
    """data: datasets already built (default: built here). adapt_model: applied to the model
    on the meta device before the engine wraps it (`shardlab verify`: float64, dropout off)."""
    seed_everything(cfg.seed)
    validate_for_world(cfg, rt.world_size)
    t, p = cfg.train, cfg.parallel
    data = data if data is not None else build_datasets(cfg)
    # this rank's batches, step by step (data/loader.py): the sampler, the layout at this world size, the loader
    sampler = make_sampler(data, t.global_batch_size, cfg.seed, cfg.data.shuffle)
    layout = layout_for(t.global_batch_size, t.micro_batch_size, rt.world_size)
    if layout.lowered and rt.is_main:
        print(layout.note(t.global_batch_size), flush=True)
    batches = StepBatches(data.train, sampler, rt.rank, rt.world_size, layout.micro, t.steps, rt.device,
                          cfg.data.num_workers)
    # Sharded engines materialize only their shard from the meta device; the others materialize whole.
    model = build_model(cfg.model, seed=cfg.seed, vocab_size=data.vocab_size, device="meta", loss=t.loss)
    if cfg.model.sync_batchnorm and engine_class(p.strategy).distributed:
        model = convert_sync_batchnorm(model, rt.device)
    if adapt_model is not None:
        model = adapt_model(model)
    n_params, n_trainable = count_parameters(model), count_parameters(model, trainable_only=True)
    model = shardlab.parallelize(model, p.strategy, wrap=p.wrap_classes or None, device=rt.device,
                                 activation_checkpointing=t.activation_checkpointing, ac_every=t.ac_every,
                                 compile=t.compile, compile_mode=t.compile_mode, **engine_options(p))
    engine = engine_of(model)
    if not engine.local_parameters():
        raise ValueError(f"rank {rt.rank} holds no parameter with parallel.strategy={p.strategy} at world "
                         f"size {rt.world_size} (the engine's warning above says why): use fewer workers or a "
                         "parallel.strategy that slices every tensor.")
    opt = make_optimizer(t, model.parameters())
    sched = make_schedule(t, opt)
    # fp16 anywhere in the compute (autocast or the engine's gathered parameters) needs scaling
    scaler = make_loss_scaler("fp16" in (t.precision, p.mixed_precision), rt.device,
                              rt.distributed and rt.world_size > 1, init_scale=t.loss_scale,
                              growth_interval=t.loss_scale_growth_interval)
    state, out_dir = TrainState(), run_dir(cfg.output)
    manager, resumed_from = _resume(cfg, out_dir, rt, model, opt, sched, state)
    c = cfg.checkpoint
    cost = CheckpointCost(manager.root, rt, c.every_seconds) if manager is not None else None
    if scaler is not None and state.loss_scaler is not None:
        scaler.load_state_dict(state.loss_scaler)
    _check_same_corpus(state, data.manifest_sha256, manager)
    return Run(cfg, rt, out_dir, data, model, engine, opt, sched, scaler, sampler, manager, state,
               layout.accumulation, n_params, n_trainable, resumed_from, batches, cost, layout)


def _resume(cfg: Config, out_dir: str, rt: Runtime, model: nn.Module, opt, sched, state: TrainState
            ) -> tuple[Any, str | None]:
    """The checkpoint manager when anything is saved or resumed (docs/checkpointing.md), and the
    checkpoint the state was restored from, if any."""
    c = cfg.checkpoint
    if not (c.every_steps > 0 or c.every_seconds or c.final or c.resume != "none" or cfg.preemption.enabled):
        return None, None
    from shardlab.checkpoint import (
        CheckpointManager,  # deferred: torch.distributed.checkpoint is slow to import
    )

    manager = CheckpointManager.from_config(cfg, out_dir, rt)
    return manager, manager.maybe_resume(model, opt, sched, state)


def _check_same_corpus(state: TrainState, manifest_sha256: str | None, manager) -> None:
    """A checkpoint trained on one prepared corpus resumes on that corpus only."""
    if state.data_manifest is not None and manifest_sha256 is not None and state.data_manifest != manifest_sha256:
        from shardlab.checkpoint import CheckpointError

        raise CheckpointError(
            f"the checkpoint in {manager.root} was trained on the corpus with manifest SHA-256 "
            f"{state.data_manifest[:16]}..., but this run's data has {manifest_sha256[:16]}...: its step would "
            "index other data. Point data.path (or data.mix, with the same weights) at the corpus it was trained on, "
            "or start a new run (checkpoint.resume=none, or another output.run_name)")
    state.data_manifest = manifest_sha256


def start_runtime(p: ParallelConfig) -> Runtime:
    """This worker's place in the job and its process group (runtime.py): the distributed engines
    need one even at world size 1."""
    return init_runtime(p.backend, p.timeout_s, force_group=engine_class(p.strategy).distributed)


def start_run(cfg: Config, rt: Runtime) -> Run:
    """The run, watched by this rank's hang doctor (doctor.enabled; docs/debugging.md): its flight
    file under <run dir>/debug, named by the rank in the process group the collectives run on,
    from before the build (a hang while building shows too); its units label the collectives."""
    if cfg.doctor.enabled:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (rt.rank, rt.world_size)
        doctor.start(run_dir(cfg.output), rank, world, rt.restart_count, capacity=cfg.doctor.record_size,
                     strategy=cfg.parallel.strategy, timeout_s=cfg.parallel.timeout_s)
    run = build_run(cfg, rt)
    doctor.run_built(run.engine)  # phase "loop" from here
    at_end = run.state.step >= cfg.train.steps  # the same on every rank: one checkpoint
    metrics = read_json(os.path.join(run.out_dir, "metrics.json")) if at_end and rt.is_main else None
    run.finished = finished_record(run, metrics) if at_end else None
    if run.finished is None:  # a finished run's run_args.json and elastic members stay as they were
        write_start(run)
    return run


def finished_record(run: Run, metrics: Any) -> Finished | None:
    """The run's metrics.json when this group resumed at (or past) train.steps and that file
    records the step: nothing to train, nothing to rewrite ([Note: records stay true] in
    run_summary.py). `metrics`: the file as rank 0 read it (None on the other ranks); every rank
    returns rank 0's answer."""
    mine = metrics if isinstance(metrics, dict) and metrics.get("steps") == run.state.step else None
    found = all_gather_object(mine, run.rt)[0]
    return Finished(found) if found is not None else None


# -- what a run writes and says before its first step ---------------------------------------------
def run_dir(o: OutputConfig) -> str:
    return os.path.join(o.dir, o.run_name)


def write_start(run: Run) -> None:
    """Before the first step: run_args.json, config.yaml and the tokenizer into the run directory,
    and rank 0's opening lines: the checkpoint it resumed, a schedule kept from it (schedule.py),
    what happened to the data (Datasets.report), how the model attends."""
    cfg, rt = run.cfg, run.rt
    nodes = all_gather_object((hostname(), elastic.node_id()), rt)
    hosts = [host for host, _ in nodes]
    if elastic.launched():  # an elastic job whose group changed: one line after the first step (loop/elastic.py)
        run.change = elastic.membership(run.out_dir, [node for _, node in nodes], rt.is_main,
                                        run.layout, run.state.step)
    if not rt.is_main:
        return
    describe = getattr(run.engine.unwrapped(), "attention_record", None)  # models/hf.py: implementation, packing
    attention = describe(cfg.data.packing) if describe is not None else None
    args = run_args(cfg.to_dict(), rt.world_size, hosts,
                    {"num_parameters": run.num_parameters, "num_trainable_parameters": run.num_trainable,
                     "accumulation_steps": run.accumulation, "data": run.data.info,
                     "restart_count": rt.restart_count, "resumed_from_step": run.state.step, "attention": attention})
    config_yaml = dump_config(cfg)
    os.makedirs(run.out_dir, exist_ok=True)
    write_json_atomic(os.path.join(run.out_dir, "run_args.json"), args, default=str)
    with open(os.path.join(run.out_dir, "config.yaml"), "w") as f:
        f.write(config_yaml)
    if run.data.tokenizer_dir:  # exports read it from here (a trained one lives in a cache)
        from shardlab.data.sft import SFTTokenizer

        SFTTokenizer(run.data.tokenizer_dir).save(os.path.join(run.out_dir, "tokenizer"))
    elif run.data.tokenizer_files:  # a prepared corpus's tokenizer: `generate` decodes with it
        copy_tokenizer_files(run.data.tokenizer_files, os.path.join(run.out_dir, "tokenizer"))
    lines = list(run.data.report)
    if attention is not None:
        packed = attention["packed_examples"]
        lines.append(f"model: attention {attention['implementation']}"
                     + (f"; packed examples kept apart by {packed}" if packed else ""))
    if run.resumed_from:
        lines.insert(0, f"shardlab: resumed from step {run.state.step} of {run.out_dir} ({run.resumed_from})")
        note = schedule_note(cfg.train, run.sched)
        lines[1:1] = [note] if note else []
    for line in lines:
        print(line, flush=True)


def run_args(cfg_dict: dict, world_size: int, hostnames: list[str], extra: dict | None = None) -> dict:
    """What run_args.json holds: the config, where and with what the run started."""
    return {
        "config": cfg_dict,
        "world_size": world_size,
        "hostnames": hostnames,
        "shardlab_version": shardlab.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(os.path.dirname(os.path.abspath(__file__))),
        "argv": sys.argv,
        **(extra or {}),
    }


def git_commit(path: str | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path or os.getcwd(), capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# how a run is watched, stopped or resumed, not what it trains: changing these keeps the run name
RUN_NAME_IGNORES = ("train.steps", "train.log_every", "train.eval_every", "train.memory_tracking", "train.profile",
                    "train.profile_steps", "parallel.timeout_s", "checkpoint", "preemption", "output", "export", "doctor")


def default_run_name(cfg: Config) -> str:
    """<model>-<strategy>-<8 hex digits of the config without RUN_NAME_IGNORES>: the same command
    names the same run directory, so it resumes from that run's latest checkpoint (also with a
    higher train.steps, to train longer), under any launcher, restart or requeue."""
    d = cfg.to_dict()
    for key in RUN_NAME_IGNORES:
        section, _, name = key.partition(".")
        d[section].pop(name) if name else d.pop(section)
    digest = hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{cfg.model.name}-{cfg.parallel.strategy}-{digest}"
