"""The training loop. It never asks which engine it drives: the engine hides all
communication behind `parallelize`, `no_sync`, `clip_grad_norm_` and `full_state_dict`.

Read it in four parts: `build_run` (model, engine, optimizer, data, checkpoint manager),
`train_step` (one global batch), `StepLogger` (progress bar, TensorBoard, non-finite
check) and `summarize` (metrics.json, in run_summary.py). `train` strings them together.

One step = one global batch = world_size x accumulation x micro_batch_size samples:
  for each micro batch: forward and backward, inside no_sync for all but the last
  unscale (fp16), clip the global gradient norm, optimizer step, LR schedule step
  each micro batch's loss weighs by its share of the global batch's target tokens (counted
  before the forward passes, one all-reduce: [Note: token-weighted loss] in loss.py); the
  logged loss is the mean over every target token of the global batch (one tiny all-reduce)
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardlab
from shardlab import memory
from shardlab import metrics as M
from shardlab.amp import autocast, make_loss_scaler
from shardlab.config import Config, dump_config, engine_options, validate_for_world
from shardlab.data import GlobalBatchSampler, build_datasets, make_sampler
from shardlab.data.loader import StepBatches
from shardlab.data.text import copy_tokenizer_files
from shardlab.doctor import RECORDER
from shardlab.doctor import worker as doctor
from shardlab.engines import Engine, collectives, engine_class, engine_of, optimizer_state_bytes
from shardlab.engines.compile import CompileClock
from shardlab.evaluate import evaluate
from shardlab.loss import token_weights
from shardlab.models import build_model, count_parameters
from shardlab.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionGuard
from shardlab.run_summary import print_summary, summarize
from shardlab.runtime import Runtime, all_gather_object, hostname, init_runtime, seed_everything, shutdown
from shardlab.schedule import make_schedule, schedule_note
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


def run_dir(cfg: Config) -> str:
    return os.path.join(cfg.output.dir, cfg.output.run_name)


def build_model_for(cfg: Config, vocab_size: int | None, device: str) -> nn.Module:
    return build_model(cfg.model, seed=cfg.seed, vocab_size=vocab_size, device=device, loss=cfg.train.loss)


def wrap_units(cfg: Config, model: nn.Module):
    """parallel.wrap_classes: the modules of those class names (null: the model's default units)."""
    names = cfg.parallel.wrap_classes
    if not names:
        return None
    found = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"parallel.wrap_classes: no module of class {missing} in the model; its classes include "
                         f"{sorted(found)[:12]}")
    return lambda m: type(m).__name__ in names


def make_optimizer(cfg: Config, params) -> torch.optim.Optimizer:
    t = cfg.train
    params = list(params)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    # foreach=False: the same kernels whatever the number or shape of the (sharded) tensors,
    # so every engine's update is the same arithmetic as single's.
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                             foreach=False)


def uses_fp16(cfg: Config) -> bool:
    """fp16 anywhere in the compute (autocast or the engine's gathered parameters) needs scaling."""
    return cfg.train.precision == "fp16" or cfg.parallel.mixed_precision == "fp16"


def _all_reduce_mean(value: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.distributed and rt.world_size > 1:
        collectives.all_reduce(value)  # through collectives: in the hang doctor's record
        value = value / rt.world_size
    return value


def _seconds_since(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if after is None:
        return None
    before = before or {}
    return {kind: seconds - before.get(kind, 0.0) for kind, seconds in after.items()}


def _per_kind(steps: list[dict[str, float] | None]) -> dict[str, list[float]] | None:
    """[{kind: s}, ...] per step -> {kind: [s per step]} (0.0 in steps without that kind)."""
    if not steps or any(s is None for s in steps):
        return None
    kinds = sorted({k for s in steps for k in s})
    return {k: [s.get(k, 0.0) for s in steps] for k in kinds}


def _comm_since(before: dict | None, after: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {}
    return {kind: {k: v - before.get(kind, {}).get(k, 0) for k, v in totals.items()} for kind, totals in after.items()}


# -- building the run -------------------------------------------------------------------------------
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

    def save_if_due(self, final: bool = False) -> None:
        if self.manager is None:
            return
        if self.scaler is not None:
            self.state.loss_scaler = self.scaler.state_dict()
        with memory.phase_range("checkpoint"):
            if final:
                self.manager.finalize(self.model, self.opt, self.sched, self.state)
            else:
                self.manager.maybe_save(self.model, self.opt, self.sched, self.state)

    def save_now(self) -> str:
        """A synchronous checkpoint of the current step (a preemption's), unless that step is
        saved already; any in-flight asynchronous save is committed first."""
        if self.scaler is not None:
            self.state.loss_scaler = self.scaler.state_dict()
        m = self.manager
        with memory.phase_range("checkpoint"):
            if m.last_saved_step != self.state.step:
                m.refuse_non_finite(self.model, self.state.step)
                m.save(self.model, self.opt, self.sched, self.state, blocking=True)
            m.wait()
        from shardlab.checkpoint import step_dir_name

        return os.path.join(m.root, step_dir_name(self.state.step))


def build_run(cfg: Config, rt: Runtime, *, data: Any = None,
              adapt_model: Callable[[nn.Module], nn.Module] | None = None) -> Run:
    """data: datasets already built (default: built here). adapt_model: applied to the model
    on the meta device before the engine wraps it (`shardlab verify`: float64, dropout off)."""
    validate_for_world(cfg, rt.world_size)
    seed_everything(cfg.seed)
    t = cfg.train
    data = data if data is not None else build_datasets(cfg)
    # Sharded engines materialize only their shard from the meta device; the others materialize whole.
    model = build_model_for(cfg, data.vocab_size, "meta")
    if cfg.model.sync_batchnorm and engine_class(cfg.parallel.strategy).distributed:
        model = convert_sync_batchnorm(model, rt.device)
    if adapt_model is not None:
        model = adapt_model(model)
    n_params, n_trainable = count_parameters(model), count_parameters(model, trainable_only=True)
    model = shardlab.parallelize(model, cfg.parallel.strategy, wrap=wrap_units(cfg, model), device=rt.device,
                                 activation_checkpointing=t.activation_checkpointing, ac_every=t.ac_every,
                                 compile=t.compile, compile_mode=t.compile_mode, **engine_options(cfg))
    engine = engine_of(model)
    if not engine.local_parameters():
        raise ValueError(f"rank {rt.rank} holds no parameter with parallel.strategy={cfg.parallel.strategy} at world "
                         f"size {rt.world_size} (the engine's warning above says why): use fewer workers or a "
                         "parallel.strategy that slices every tensor.")
    opt = make_optimizer(cfg, model.parameters())
    sched = make_schedule(cfg, opt)
    scaler = make_loss_scaler(uses_fp16(cfg), rt.device, rt.distributed and rt.world_size > 1,
                              init_scale=t.loss_scale, growth_interval=t.loss_scale_growth_interval)
    state = TrainState()
    out_dir = run_dir(cfg)
    manager = resumed_from = None
    c = cfg.checkpoint
    if c.every_steps > 0 or c.final or c.resume != "none" or cfg.preemption.enabled:
        # sharded save and exact resume: docs/checkpointing.md
        from shardlab.checkpoint import CheckpointManager

        manager = CheckpointManager.from_config(cfg, out_dir, rt)
        resumed_from = manager.maybe_resume(model, opt, sched, state)
    if scaler is not None and state.loss_scaler is not None:
        scaler.load_state_dict(state.loss_scaler)
    _check_same_corpus(state, data.manifest_sha256, manager)
    sampler = make_sampler(data, t.global_batch_size, cfg.seed, cfg.data.shuffle)
    accumulation = t.global_batch_size // (rt.world_size * t.micro_batch_size)
    batches = StepBatches(data.train, sampler, rt.rank, rt.world_size, t.micro_batch_size, t.steps, rt.device,
                          cfg.data.num_workers)
    return Run(cfg, rt, out_dir, data, model, engine, opt, sched, scaler, sampler, manager, state,
               accumulation, n_params, n_trainable, resumed_from, batches)


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


def write_run_args(run: Run) -> None:
    cfg, rt = run.cfg, run.rt
    hosts = all_gather_object(hostname(), rt)
    if rt.is_main:
        os.makedirs(run.out_dir, exist_ok=True)
        M.write_json_atomic(os.path.join(run.out_dir, "run_args.json"), M.run_args(
            cfg.to_dict(), rt.world_size, hosts,
            {"num_parameters": run.num_parameters, "num_trainable_parameters": run.num_trainable,
             "accumulation_steps": run.accumulation, "data": run.data.info,
             "restart_count": rt.restart_count, "resumed_from_step": run.state.step,
             "attention": attention_record(run)}), default=str)
        with open(os.path.join(run.out_dir, "config.yaml"), "w") as f:
            f.write(dump_config(cfg))
        if run.data.tokenizer_dir:  # exports read it from here (a trained one lives in a cache)
            from shardlab.data.sft import SFTTokenizer

            SFTTokenizer(run.data.tokenizer_dir).save(os.path.join(run.out_dir, "tokenizer"))
        elif run.data.tokenizer_files:  # a prepared corpus's tokenizer: `generate` decodes with it
            copy_tokenizer_files(run.data.tokenizer_files, os.path.join(run.out_dir, "tokenizer"))


def attention_record(run: Run) -> dict[str, Any] | None:
    """A model that says how it attends (models/hf.py: the implementation, how packed examples are
    kept apart), else None."""
    describe = getattr(run.engine.unwrapped(), "attention_record", None)
    return describe(run.cfg.data.packing) if describe is not None else None


def announce(run: Run) -> None:
    """Rank 0 says what the run starts from: the checkpoint it resumed, a schedule kept from it
    (schedule.py), and what happened to the data (Datasets.report)."""
    if not run.rt.is_main:
        return
    lines = list(run.data.report)
    attention = attention_record(run)
    if attention is not None:
        packed = attention["packed_examples"]
        lines.append(f"model: attention {attention['implementation']}"
                     + (f"; packed examples kept apart by {packed}" if packed else ""))
    if run.resumed_from:
        lines.insert(0, f"shardlab: resumed from step {run.state.step} of {run.out_dir} ({run.resumed_from})")
        note = schedule_note(run.cfg, run.sched)
        lines[1:1] = [note] if note else []
    for line in lines:
        print(line, flush=True)


# -- one step ---------------------------------------------------------------------------------------
@dataclass
class StepResult:
    loss: float           # the step's loss: mean over every target token of the global batch
    grad_norm: float      # global gradient norm before clipping (inf/nan on an fp16 overflow)
    skipped: bool         # fp16 overflow: the optimizer did not step


def train_step(run: Run, tracker: memory.LiveMemoryTracker | None = None,
               before_clip: Callable[[Run], None] | None = None) -> StepResult:
    """One global batch: k micro batches (backward inside no_sync for all but the last, so only
    the last one communicates), then unscale, clip, step. The phases are marked for the memory
    tracker and the profiler. before_clip(run) sees the gradients as backward left them
    (unscaled), before clipping and the optimizer step (`shardlab verify` reads them)."""
    rt, t = run.rt, run.cfg.train
    phase = tracker.phase if tracker is not None else memory.phase_range
    model, opt, scaler = run.model, run.opt, run.scaler
    # all k micro batches first: each weighs by its target tokens in the global batch ([Note:
    # token-weighted loss] in loss.py), counted before any forward
    with memory.phase_range("data"):  # not a tracker phase: its bytes stay "other" (docs/memory.md)
        batches = [run.batches.next(run.state.step) for _ in range(run.accumulation)]
    weights = token_weights([y for _, y in batches], rt.world_size, rt.device, rt.distributed)
    local_loss = None
    for i, (x, y) in enumerate(batches):
        x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
        last = i == run.accumulation - 1
        # backward must run inside no_sync too: the engines read the flag while backward runs.
        with contextlib.nullcontext() if last else shardlab.no_sync(model):
            with phase("forward"), autocast(t.precision, rt.device):
                loss = weights.scale(model(x, y), i)
            with phase("backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        term = loss.detach().to(torch.promote_types(loss.dtype, torch.float32))
        local_loss = term if local_loss is None else local_loss + term
    with phase("optimizer"):
        if scaler is not None:
            scaler.unscale_(opt)  # before clipping: the norm is of the true gradients
        if before_clip is not None:
            before_clip(run)
        grad_norm = shardlab.clip_grad_norm_(model, t.grad_clip if t.grad_clip > 0 else float("inf"))
        skipped = False
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.step(opt)      # skipped when any rank found an inf/nan (one verdict: shardlab.amp)
            scaler.update()
            skipped = scaler.get_scale() < scale
        else:
            opt.step()
        run.sched.step()
    return StepResult(_all_reduce_mean(local_loss, rt).item(), float(grad_norm), skipped)


# -- logging ----------------------------------------------------------------------------------------
class StepLogger:
    """Rank 0's progress bar and TensorBoard scalars; every rank's non-finite loss check."""

    def __init__(self, run: Run):
        cfg, rt = run.cfg, run.rt
        self.run = run
        self.writer = self.bar = None
        if rt.is_main and cfg.output.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(run.out_dir, "tensorboard"))
        if rt.is_main and cfg.output.progress:
            from tqdm import tqdm

            # A worker's stderr goes to a file (launcher.py), so on a terminal the bar is drawn on
            # stdout, which stays the terminal's; piped (CI, Slurm, tests) it stays on stderr.
            out = sys.stdout if sys.stdout.isatty() else sys.stderr
            self.bar = tqdm(total=cfg.train.steps, initial=run.state.step, unit="step", dynamic_ncols=True,
                            desc=f"{cfg.parallel.strategy} x{rt.world_size}", file=out)

    def log(self, r: StepResult, step_time: float) -> None:
        step, t = self.run.state.step, self.run.cfg.train
        if not math.isfinite(r.loss):
            self.close()
            raise FloatingPointError(
                f"the loss is {r.loss} at step {step}: training stopped. Lower train.lr, "
                "enable train.grad_clip, or check the data; the last good checkpoint (if any) is kept.")
        samples_s = t.global_batch_size / step_time
        if self.writer is not None and step % t.log_every == 0:
            self.writer.add_scalar("train/loss", r.loss, step)
            self.writer.add_scalar("train/lr", self.run.sched.get_last_lr()[0], step)
            self.writer.add_scalar("train/grad_norm", r.grad_norm, step)
            self.writer.add_scalar("perf/samples_per_s", samples_s, step)
            if self.run.scaler is not None:
                self.writer.add_scalar("train/loss_scale", self.run.scaler.get_scale(), step)
        if self.bar is not None:
            post = {"loss": f"{r.loss:.4f}", "samples/s": f"{samples_s:.1f}"}
            if self.run.data.tokens_per_sample:
                post["tok/s"] = f"{samples_s * self.run.data.tokens_per_sample:.0f}"
            if r.skipped:
                post["skipped"] = "fp16 overflow"
            self.bar.set_postfix(post)
            self.bar.update(1)

    def scalar(self, tag: str, value: float | None, step: int) -> None:
        if self.writer is not None and value is not None:
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# -- the loop ---------------------------------------------------------------------------------------
def train(cfg: Config, rt: Runtime | None = None) -> dict[str, Any]:
    """Train with `cfg` in this worker; returns the metrics (written by rank 0). Raises
    Preempted once a SIGTERM/SIGUSR1 turned into a complete checkpoint (docs/preemption.md)."""
    with PreemptionGuard(cfg.preemption.enabled) as guard, doctor.attending(Preempted):
        return _train(cfg, rt, guard)


def _train(cfg: Config, rt: Runtime | None, guard: PreemptionGuard) -> dict[str, Any]:
    t0, compile_clock = time.perf_counter(), CompileClock()  # compile_clock: this run's share of torch.compile time
    rt = rt or init_runtime(cfg.parallel.backend, cfg.parallel.timeout_s,
                            force_group=engine_class(cfg.parallel.strategy).distributed)
    run = start_run(cfg, rt)
    write_run_args(run)
    announce(run)
    logger = StepLogger(run)
    state, t = run.state, cfg.train
    timer = M.StepTimer(warmup=1)
    val_losses: dict[int, float | None] = {}
    state_bytes = None
    run.model.train()
    comm_before_loop = run.engine.comm_stats()  # wrap-time broadcasts and resume are not step traffic
    step_comm_seconds: list[dict[str, float] | None] = []  # per step: seconds per collective kind
    # live tensor bytes by part and phase (docs/memory.md); "last" tracks only the last step (the others carry none
    # of its overhead). Not under train.compile: dynamo would stop compiling for the rest of the process (memory.md).
    tracker = None if t.memory_tracking == "none" or t.compile else memory.LiveMemoryTracker(
        rt.device, engine=run.engine, optimizer=run.opt)
    profiler = None
    if t.profile:  # the first step of this run is its warm-up
        first = state.step + 1 if t.steps - state.step > 1 else state.step
        profiler = memory.StepProfiler(run.out_dir, rt.rank, first, t.profile_steps, rt.device)
    try:
        while state.step < t.steps:
            RECORDER.set_step(state.step + 1)  # the heartbeat counts steps from 1: "step 5" is the fifth
            # the step boundary: all ranks agree whether a signal arrived (one tiny all-reduce)
            if guard.should_stop(rt):
                raise Preempted(guard.save_and_record(run))
            if profiler is not None:
                profiler.before_step(state.step)
            start = time.perf_counter()
            comm_seconds_before = run.engine.comm_seconds()
            if tracker is not None:
                with tracker.step(state.step, active=t.memory_tracking == "all" or state.step + 1 == t.steps):
                    r = train_step(run, tracker)
            else:
                r = train_step(run)
            step_comm_seconds.append(_seconds_since(comm_seconds_before, run.engine.comm_seconds()))
            if state.step + 1 == t.steps:  # measured while gradients and optimizer state both exist
                state_bytes = {**run.engine.model_state_bytes(), "optimizer": optimizer_state_bytes(run.opt)}
            run.opt.zero_grad(set_to_none=True)
            timer.add(time.perf_counter() - start)
            if profiler is not None:
                profiler.after_step(state.step)
            state.step += 1
            state.losses.append(r.loss)
            state.skipped_steps += r.skipped
            logger.log(r, timer.times[-1])
            if t.eval_every and state.step % t.eval_every == 0 and state.step < t.steps:
                with memory.phase_range("eval"):
                    val_losses[state.step] = evaluate(run.model, run.data.val, cfg, rt)
                logger.scalar("val/loss", val_losses[state.step], state.step)
            run.save_if_due()
        train_comm = _comm_since(comm_before_loop, run.engine.comm_stats())  # before the final eval's traffic
        run.save_if_due(final=True)
        with memory.phase_range("eval"):
            val_losses[state.step] = evaluate(run.model, run.data.val, cfg, rt)
        if cfg.export.format == "hf":  # every rank gathers, rank 0 writes (export_hf.py)
            from shardlab.export_hf import export_at_end

            export_at_end(run)
    finally:
        logger.close()
        if profiler is not None:
            profiler.close()
    if state_bytes is None:  # resumed at the last step: nothing trained in this run
        state_bytes = {**run.engine.model_state_bytes(), "optimizer": optimizer_state_bytes(run.opt)}
    peak = M.peak_memory_bytes(rt.device)
    if tracker is not None:  # on CUDA the tracker resets the allocator's peak between phases
        peak = max(peak, tracker.allocator_peak_seen)
    live = tracker.summary() if tracker is not None and tracker.steps_tracked else None
    per_rank = all_gather_object({"peak_memory_bytes": peak, "model_state_bytes": state_bytes,
                                  "comm": train_comm, "comm_seconds": _per_kind(step_comm_seconds),
                                  "live": live, "compile": (compile_clock.seconds(), compile_clock.graphs())}, rt)
    result = summarize(run, timer, per_rank, val_losses, time.perf_counter() - t0)
    if rt.is_main:
        M.write_json_atomic(os.path.join(run.out_dir, "metrics.json"), result, default=str)
    return result


def start_run(cfg: Config, rt: Runtime) -> Run:
    """The run, watched by this rank's hang doctor (doctor.enabled; docs/debugging.md): its flight
    file under <run dir>/debug, named by the rank in the process group the collectives run on,
    from before the build (a hang while building shows too); its units label the collectives."""
    if cfg.doctor.enabled:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (rt.rank, rt.world_size)
        doctor.start(run_dir(cfg), rank, world, rt.restart_count, capacity=cfg.doctor.record_size,
                     strategy=cfg.parallel.strategy, timeout_s=cfg.parallel.timeout_s)
    run = build_run(cfg, rt)
    doctor.run_built(run.engine)  # phase "loop" from here
    return run


def worker_main(cfg: Config) -> int:
    """Entry point of one worker process (under shardlab's launcher, torchrun, srun or a pod).
    Exit codes: 0 done, PREEMPTED_EXIT_CODE (75) a signal was turned into a checkpoint."""
    rt = init_runtime(cfg.parallel.backend, cfg.parallel.timeout_s,
                      force_group=engine_class(cfg.parallel.strategy).distributed)
    clean = False
    try:
        if not cfg.output.run_name:  # the same on every rank: a function of the config
            cfg.output.run_name = default_run_name(cfg)
        result = train(cfg, rt)
        if rt.is_main:
            print_summary(result, run_dir(cfg))
        clean = True
        return 0
    except Preempted as p:
        if rt.is_main:
            print(f"shardlab: {p}; exit code {PREEMPTED_EXIT_CODE}. The same command (checkpoint.resume=auto) "
                  "continues from it.", flush=True)
        return PREEMPTED_EXIT_CODE
    except BaseException as e:
        # says "lost contact" if a peer died or hung; the exit record and others' stacks in <run dir>/debug
        doctor.worker_failed(e, rt.rank, rt.distributed, cfg.parallel.timeout_s)
        _record_for_agent(e)
        raise
    finally:
        shutdown(clean)  # see [Note: tearing down the process group] in runtime.py


def _record_for_agent(e: BaseException) -> None:
    """The exception into torch's error file (TORCHELASTIC_ERROR_FILE, set by torchrun's agent),
    as torch's `@record` would: the agent's failure then carries its message (ProcessFailure),
    which the launchers show when the doctor is off. `@record` itself is not used: it turns
    faulthandler on for stderr, where the doctor keeps fatal stacks in its own file."""
    if isinstance(e, Exception) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)


# how a run is watched, stopped or resumed, not what it trains: changing these keeps the run name
RUN_NAME_IGNORES = ("train.steps", "train.log_every", "train.eval_every", "train.memory_tracking", "train.profile",
                    "train.profile_steps", "parallel.timeout_s", "checkpoint", "preemption", "output", "export", "doctor")


def default_run_name(cfg: Config) -> str:
    """<model>-<strategy>-<8 hex digits of the config without RUN_NAME_IGNORES>: the same command
    names the same run directory, so it resumes from that run's latest checkpoint (also with a
    higher train.steps, to train longer), under any launcher, restart or requeue."""
    import hashlib
    import json

    d = cfg.to_dict()
    for key in RUN_NAME_IGNORES:
        section, _, name = key.partition(".")
        d[section].pop(name) if name else d.pop(section)
    digest = hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{cfg.model.name}-{cfg.parallel.strategy}-{digest}"
