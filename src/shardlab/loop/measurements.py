"""What one worker measures of its run, in one object the loop calls (`RunMeasurements`): wall and
compile time, step times, the traffic and seconds of each step's collectives, live memory by part
and phase (shardlab.memory), the torch.profiler trace, the model state kept, the validation losses,
MFU (`StepFlops`); and what it shows and records while training (`StepLogger`: rank 0's progress
bar, `<run dir>/steps.jsonl` and the trackers of `output.trackers`, observe/trackers.py). At the
end `summary` gathers every rank's figures into metrics.json (run_summary.py). `shardlab report`
and `shardlab trace` read what it wrote (observe/, docs/observability.md).

[Note: how MFU is computed]
FLOPs: the first step this run trains is counted on rank 0 as it runs (`CountFlops`, the
counter plan's probes use: every matmul, convolution and attention kernel the step dispatches,
by torch's formulas, recomputation included). Per token: that count over the token positions of
rank 0's share of the global batch (samples x tokens per sample, padding included: the
kernels compute them). Every step of a run has the same shapes, so the count holds for each.
MFU of a step = FLOPs of one rank's step / the step's wall time / one device's peak
(observe/flops.py's `device_peak`) = FLOPs per token x global tokens/s / (world x peak),
torchtitan's formula with executed FLOPs in place of its 6N + 12 L H Q T model FLOPs: the same
without activation checkpointing, more by the recomputed forward with it (docs/observability.md).
Under `train.compile` the compiled kernels do not pass through the dispatcher: nothing is counted
and MFU is null, with the reason in metrics.json.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from shardlab import memory
from shardlab.config import OutputConfig, TrainConfig, dump_config
from shardlab.engines import optimizer_state_bytes
from shardlab.engines.compile import CompileClock
from shardlab.loop import metrics as M
from shardlab.loop.evaluate import Evaluation
from shardlab.loop.preemption import Preempted
from shardlab.loop.router_stats import router_section
from shardlab.loop.run_summary import step_tokens, summarize
from shardlab.observe.flops import StepFlops
from shardlab.observe.runs import STEPS_FILE
from shardlab.observe.trackers import Trackers, resolve_trackers

# [Note: progress for terminals and for logs]
# A worker's stdout is the launcher's (torchrun and shardlab's launcher pass it through; its stderr
# goes to a file: loop/launcher.py), so the worker asks stdout whether a person watches. On a
# terminal rank 0 draws a progress bar there, and every line printed while it is drawn (a save's
# line, an elastic group's) goes above it (`StepLogger.printing`). Piped (CI, Slurm, nohup, a
# test) a bar's frames would be a line each, so a line every `line_interval` steps instead. The
# libraries' own bars (transformers writing model shards, datasets, the Hugging Face hub) would
# go to the worker's stderr, which the launcher reads back as warnings: a worker turns them off
# (`quiet_library_bars`).
LIBRARY_BARS_OFF = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def quiet_library_bars() -> None:
    """The Hugging Face libraries' progress bars off in this process: by environment for those not
    imported yet (they read it once, at import), by their switch for those already imported."""
    os.environ.update(LIBRARY_BARS_OFF)
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def line_interval(steps: int, log_every: int) -> int:
    """Steps between two progress lines on a piped stdout: about ten lines a run, on a round
    number of steps (1, 2, 5, 10, 20, 50, ...), never more often than train.log_every."""
    target, scale = max(1, steps // 10), 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale >= target:
                return max(log_every, mantissa * scale)
        scale *= 10


class StepLogger:
    """Rank 0's progress (a bar on a terminal, a line every few steps in a log: [Note: progress for
    terminals and for logs]) and what each step measured: a line of `<run dir>/steps.jsonl` and the
    scalars of the trackers `output.trackers` names (TensorBoard by default); every rank's
    non-finite loss check."""

    def __init__(self, run: Any, o: OutputConfig, t: TrainConfig):
        self.run, self.t = run, t
        self.bar = self.lines = None
        self.every = 0  # steps between progress lines on a piped stdout (0: none)
        self.started = time.perf_counter()
        self.trackers: Trackers | None = None
        if not run.rt.is_main:
            return
        os.makedirs(run.out_dir, exist_ok=True)
        self.lines = open(os.path.join(run.out_dir, STEPS_FILE), "a", buffering=1)
        self._write({"event": "start", "attempt": run.rt.restart_count, "world": run.rt.world_size,
                     "step": run.state.step, "launch": os.environ.get("TORCHELASTIC_RUN_ID")})
        terminal = sys.stdout.isatty()
        if o.progress and not terminal:
            self.every = line_interval(t.steps, t.log_every)
        self.trackers = Trackers(resolve_trackers(o), run, dump_config(run.cfg))
        if o.progress and terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=t.steps, initial=run.state.step, unit="step", dynamic_ncols=True,
                            desc=self._label(), file=sys.stdout)

    def _label(self) -> str:
        return f"{self.run.engine.strategy} x{self.run.rt.world_size}"

    @contextlib.contextmanager
    def printing(self) -> Iterator[None]:
        """Lines printed inside go above the progress bar (tqdm clears it, then draws it again)."""
        if self.bar is None:
            yield
            return
        with self.bar.external_write_mode(file=sys.stdout):
            yield

    def end_bar(self) -> None:
        """The bar's last frame ends its line: what is printed after training starts a line of its own."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log(self, r: Any, step: int, step_time: float, mfu: float | None) -> None:
        if not math.isfinite(r.loss):
            error = FloatingPointError(
                f"the loss is {r.loss} at step {step}: training stopped. Lower train.lr, "
                "enable train.grad_clip, or check the data; the last good checkpoint (if any) is kept.")
            self.close(error)
            raise error
        if self.run.change is not None:  # the first step of an elastic group that changed (loop/elastic.py)
            with self.printing():
                print(self.run.change.line(time.time()), flush=True)
            self.run.change = None
        if self.lines is None:
            return
        with memory.phase_range("log"):  # rank 0's trackers cost time the others may wait for: shown apart
            self._log(r, step, step_time, mfu)

    def _log(self, r: Any, step: int, step_time: float, mfu: float | None) -> None:
        run, tokens = self.run, step_tokens(self.run, step - 1)
        rec: dict[str, Any] = {"step": step, "loss": r.loss, "lr": run.sched.get_last_lr()[0],
                               "grad_norm": r.grad_norm, "step_time_s": step_time,
                               "samples_per_s": self.t.global_batch_size / step_time,
                               "tokens_per_s": tokens / step_time if tokens else None, "mfu": mfu,
                               "data_wait_s": run.batches.wait_s.get(step - 1) if run.batches else None,
                               "skipped": r.skipped, "attempt": run.rt.restart_count}
        if run.scaler is not None:
            rec["loss_scale"] = run.scaler.get_scale()
        if step % self.t.log_every == 0:
            self._write(rec)
            self._track({"train/loss": r.loss, "train/lr": rec["lr"], "train/grad_norm": r.grad_norm,
                         "perf/samples_per_s": rec["samples_per_s"], "perf/tokens_per_s": rec["tokens_per_s"],
                         "perf/mfu": mfu, "train/loss_scale": rec.get("loss_scale")}, step)
        if self.bar is not None or (self.every and (step % self.every == 0 or step == self.t.steps)):
            self._progress(step, r, rec, mfu)

    def _progress(self, step: int, r: Any, rec: dict[str, Any], mfu: float | None) -> None:
        post = {"loss": f"{r.loss:.4f}", "samples/s": f"{rec['samples_per_s']:.1f}"}
        if rec["tokens_per_s"]:
            post["tok/s"] = f"{rec['tokens_per_s']:.0f}"
        if mfu is not None:
            post["mfu"] = f"{mfu:.1%}"
        if r.skipped:
            post["skipped"] = "fp16 overflow"
        if self.bar is not None:
            self.bar.set_postfix(post)
            self.bar.update(1)
        else:  # a log: one whole line
            figures = "  ".join(f"{k} {v}" for k, v in post.items())
            print(f"{self._label()}  step {step}/{self.t.steps}  {figures}  "
                  f"elapsed {time.perf_counter() - self.started:.1f} s", flush=True)

    def validation(self, v: Evaluation, step: int) -> None:
        """val/loss, and a mixture's val/loss/<corpus> beside it."""
        if self.lines is None or v.loss is None:
            return
        by_source = {f"val_loss/{name}": loss for name, loss in v.by_source.items()}
        self._write({"step": step, "val_loss": v.loss, **by_source, "attempt": self.run.rt.restart_count})
        self._track({"val/loss": v.loss, **{k.replace("_", "/", 1): x for k, x in by_source.items()}}, step)

    def close(self, error: BaseException | None) -> Trackers | None:
        """The bar and steps.jsonl closed. The trackers: with `error` (the exception ending the
        attempt) ended now, marked failed or preempted; without, returned still open, for
        `RunMeasurements.summary` to end with metrics.json."""
        self.end_bar()
        trackers, self.trackers = self.trackers, None
        if trackers is not None and error is not None:
            trackers.end(outcome="preempted" if isinstance(error, (Preempted, KeyboardInterrupt)) else "failed")
            trackers = None
        if self.lines is not None:  # the attempt's end: the step it reached ([Note: records stay true])
            with contextlib.suppress(OSError):
                self._write({"event": "end", "attempt": self.run.rt.restart_count, "step": self.run.state.step})
            self.lines.close()
            self.lines = None
        return trackers

    def _write(self, record: dict[str, Any]) -> None:
        self.lines.write(json.dumps({"time": time.time(), **record}) + "\n")

    def _track(self, scalars: dict[str, float | None], step: int) -> None:
        present = {k: float(v) for k, v in scalars.items() if v is not None}
        if self.trackers is not None:
            self.trackers.log(present, step)


class RunMeasurements:
    """Made before the run is built (its wall clock and compile time count the build), told the run
    once built (`watch`), then called around every step; `summary` ends it."""

    def __init__(self) -> None:
        self.t: TrainConfig | None = None
        self.started = time.perf_counter()
        self.compile_clock = CompileClock()  # this run's share of torch.compile time
        self.timer = M.StepTimer(warmup=1)
        self.val_losses: dict[int, Evaluation] = {}
        self.step_comm_seconds: list[dict[str, float] | None] = []  # per step: seconds per collective kind
        self.step_cpu_seconds: list[float] = []  # per step: this process's CPU seconds, every thread
        self.state_bytes: dict[str, int] | None = None
        self.run: Any = None
        self.logger: StepLogger | None = None
        self.trackers: Trackers | None = None  # rank 0's, open from the last step to metrics.json
        self.flops: StepFlops | None = None
        self.tracker: memory.LiveMemoryTracker | None = None
        self.profiler: StepProfiler | None = None
        self.comm_at_start: dict | None = None
        self.train_comm: dict | None = None

    def watch(self, run: Any, t: TrainConfig, o: OutputConfig) -> None:
        """The built run: its logger, its live-memory tracker ("last" tracks only the last step: the
        others carry none of its overhead; not under train.compile, where dynamo would stop compiling
        for the rest of the process: docs/memory.md) and profiler (the run's first step is its
        warm-up). What the engine sent until now (wrap-time broadcasts, a resume) is not step traffic."""
        rt = run.rt
        self.run, self.t = run, t
        self.logger = StepLogger(run, o, t)
        self.flops = StepFlops(run, t)
        if t.memory_tracking != "none" and not t.compile:
            self.tracker = memory.LiveMemoryTracker(rt.device, engine=run.engine, optimizer=run.opt)
        if t.profile:
            first = run.state.step + 1 if t.steps - run.state.step > 1 else run.state.step
            self.profiler = StepProfiler(run.out_dir, rt.rank, first, t.profile_steps, rt.device)
        self.comm_at_start = run.engine.comm_stats()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """One whole step, releasing the gradients included: its time, its collectives' seconds, its
        place in the profiler's trace; the first one's FLOPs (MFU)."""
        if self.profiler is not None:
            self.profiler.before_step(step)
        start, cpu = time.perf_counter(), time.process_time()
        before = self.run.engine.comm_seconds()
        with self.flops.count():
            yield
        self.step_comm_seconds.append(_seconds_since(before, self.run.engine.comm_seconds()))
        self.timer.add(time.perf_counter() - start)
        self.step_cpu_seconds.append(time.process_time() - cpu)
        if self.profiler is not None:
            self.profiler.after_step(step)

    @contextlib.contextmanager
    def live_memory(self, step: int) -> Iterator[memory.LiveMemoryTracker | None]:
        """The training part of a step: live memory by part and phase (the tracker `train_step` marks
        phases in; None when not tracked), then, at the last step, the model state kept (while the
        gradients and the optimizer state both exist)."""
        last = step + 1 == self.t.steps
        if self.tracker is None:
            yield None
        else:
            with self.tracker.step(step, active=self.t.memory_tracking == "all" or last):
                yield self.tracker
        if last:
            self.state_bytes = self._model_state()

    def record(self, result: Any, step: int) -> None:
        """A step's result, to the progress bar, steps.jsonl and the trackers; a non-finite loss stops the run."""
        seconds = self.timer.times[-1]
        self.logger.log(result, step, seconds, self.flops.mfu(seconds))

    def validation(self, step: int, v: Evaluation) -> None:
        """A validation loss (a mixture's per corpus too): into metrics.json, and to steps.jsonl and
        the trackers while the steps are logged."""
        self.val_losses[step] = v
        if self.logger is not None:
            self.logger.validation(v, step)

    def printing(self) -> contextlib.AbstractContextManager:
        """What the loop prints between steps (a save's line) goes above the progress bar."""
        return self.logger.printing() if self.logger is not None else contextlib.nullcontext()

    def training_done(self) -> None:
        """The last step is done: what the steps' collectives sent (before the final evaluation's,
        whose loss still goes to the scalars: the logger closes in `close`); the progress bar's
        line ended, so the final save's line is a line of its own."""
        self.train_comm = _comm_since(self.comm_at_start, self.run.engine.comm_stats())
        if self.logger is not None:
            self.logger.end_bar()

    def close(self) -> None:
        if self.logger is not None:
            # called in _train's `finally`: an exception on its way out ends the trackers now
            self.trackers = self.logger.close(sys.exc_info()[1])
            self.logger = None
        if self.profiler is not None:
            self.profiler.close()

    def summary(self) -> dict[str, Any]:
        """metrics.json (run_summary.py): every rank's figures; every rank returns them."""
        run = self.run
        if self.state_bytes is None:  # resumed at the last step: nothing trained in this run
            self.state_bytes = self._model_state()
        peak = M.peak_memory_bytes(run.rt.device)
        tracker = self.tracker
        if tracker is not None:  # on CUDA the tracker resets the allocator's peak between phases
            peak = max(peak, tracker.allocator_peak_seen)
        live = tracker.summary() if tracker is not None and tracker.steps_tracked else None
        mine = {"peak_memory_bytes": peak, "model_state_bytes": self.state_bytes, "comm": self.train_comm,
                "comm_seconds": _per_kind(self.step_comm_seconds), "cpu_seconds": self.step_cpu_seconds, "live": live,
                "compile": (self.compile_clock.seconds(), self.compile_clock.graphs())}
        result = None
        try:
            # rank 0's further keys: MFU; a mixture of experts' routing, gathered from every rank (router_stats.py)
            extra = {**self.flops.summary(self.timer.times), **router_section(run)}
            result = summarize(run, self.timer, mine, self.val_losses, time.perf_counter() - self.started, extra)
        finally:  # the trackers keep the run's figures and metrics.json (observe/trackers.py)
            if self.trackers is not None:
                trackers, self.trackers = self.trackers, None
                if result is None:
                    trackers.end(outcome="failed")
                else:
                    trackers.end(result, metrics_path=os.path.join(run.out_dir, "metrics.json"))
        return result

    def _model_state(self) -> dict[str, int]:
        return {**self.run.engine.model_state_bytes(), "optimizer": optimizer_state_bytes(self.run.opt)}


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


class StepProfiler:
    """A torch.profiler trace of steps [first, first + count) written as Chrome trace JSON to
    `<out_dir>/profile/rank<r>.json`: CPU (and CUDA) operators with input shapes, memory
    allocations and frees, collectives (c10d/gloo/nccl ranges) and shardlab's phase ranges.
    Open it in https://ui.perfetto.dev or chrome://tracing (docs/memory.md)."""

    def __init__(self, out_dir: str, rank: int, first: int, count: int, device: torch.device,
                 with_stack: bool = False):
        self.path = os.path.join(out_dir, "profile", f"rank{rank}.json")
        self.first, self.last = first, first + count - 1
        self.device = device
        self.with_stack = with_stack
        self.prof: torch.profiler.profile | None = None
        self.written: str | None = None

    def before_step(self, step: int) -> None:
        if step == self.first and self.prof is None and self.written is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                               with_stack=self.with_stack)
            self.prof.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is not None:
            self.prof.step()
            if step >= self.last:
                self.close()

    def close(self) -> None:
        """Stop and write (also when training ends before the last profiled step)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prof.export_chrome_trace(self.path)
        self.written = self.path
