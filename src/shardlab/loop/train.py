"""The training loop. It never asks which engine it drives: the engine hides all
communication behind `parallelize`, `no_sync`, `clip_grad_norm_` and `full_state_dict`.

`train` reads as the run goes: build it (run.py), then per step train one global batch
(`train_step`), log, evaluate and save when due, around it the run's measurements
(measurements.py), at the end its summary (metrics.json). `worker_main` is one worker process.

One step = one global batch = world_size x accumulation x micro_batch_size samples:
  for each micro batch: forward and backward, inside no_sync for all but the last
  unscale (fp16), clip the global gradient norm, optimizer step, LR schedule step
  each micro batch's loss weighs by its share of the global batch's target tokens (counted
  before the forward passes, one all-reduce: [Note: token-weighted loss] in loss.py); the
  logged loss is the mean over every target token of the global batch (one tiny all-reduce)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardlab import memory
from shardlab.config import Config
from shardlab.doctor import RECORDER
from shardlab.doctor import worker as doctor
from shardlab.loop import elastic
from shardlab.loop.loss import autocast, mean_over_ranks, token_weights
from shardlab.loop.measurements import RunMeasurements, quiet_library_bars
from shardlab.loop.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionGuard
from shardlab.loop.run import Finished, Run, default_run_name, run_dir, start_run, start_runtime
from shardlab.loop.run_summary import print_summary
from shardlab.loop.runtime import Runtime, shutdown


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
        with contextlib.nullcontext() if last else run.engine.no_sync():
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
        grad_norm = run.engine.clip_grad_norm_(t.grad_clip if t.grad_clip > 0 else float("inf"))
        skipped = False
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.step(opt)      # skipped when any rank found an inf/nan ([Note: one verdict for all ranks] in loss.py)
            scaler.update()
            skipped = scaler.get_scale() < scale
        else:
            opt.step()
        run.sched.step()
    return StepResult(mean_over_ranks(local_loss, rt.world_size, rt.distributed).item(), float(grad_norm), skipped)


# -- the loop ---------------------------------------------------------------------------------------
def train(cfg: Config, rt: Runtime) -> dict[str, Any]:
    """Train with `cfg` in this worker; returns the metrics (written by rank 0; a run that had
    finished: its metrics.json as it was, a `Finished`). Raises Preempted once a SIGTERM/SIGUSR1
    turned into a complete checkpoint (docs/preemption.md)."""
    with PreemptionGuard(cfg.preemption.enabled) as guard, doctor.attending(Preempted):
        return _train(cfg, rt, guard)


def _train(cfg: Config, rt: Runtime, guard: PreemptionGuard) -> dict[str, Any]:
    measure = RunMeasurements()  # from here: the run's wall clock and compile time
    run = start_run(cfg, rt)
    if run.finished is not None:  # it had reached its last step: nothing trained, nothing rewritten
        if rt.is_main:  # under shardlab's launcher the parent said it before any worker started (run_contract.py)
            # deferred: run_contract.py imports shardlab.checkpoint, and with it torch.distributed.checkpoint
            # (DTensor, FSDP: ~0.5 CPU-s), which a worker that saves nothing never needs
            from shardlab.loop.run_contract import finished_line

            print(finished_line(run.out_dir, run.state.step, cfg.train.steps, launcher=False), flush=True)
        return run.finished
    measure.watch(run, cfg.train, cfg.output)
    state = run.state
    run.model.train()
    try:
        while state.step < cfg.train.steps:
            RECORDER.set_step(state.step + 1)  # the heartbeat counts steps from 1: "step 5" is the fifth
            # the step boundary: all ranks agree whether a signal arrived (one tiny all-reduce)
            if guard.should_stop(rt):
                raise Preempted(guard.save_and_record(run))
            with measure.step(state.step):
                with measure.live_memory(state.step) as tracker:
                    result = train_step(run, tracker)
                run.opt.zero_grad(set_to_none=True)
            state.advance(result)
            measure.record(result, state.step)
            if run.eval_due():
                measure.validation(state.step, run.evaluate())
            with measure.printing():  # a save's line above the progress bar
                run.save_if_due()
        measure.training_done()  # the steps' traffic, before the final evaluation's; the bar's line ended
        run.save_if_due(final=True)
        measure.validation(state.step, run.evaluate())
        run.export()
    finally:
        measure.close()
    return measure.summary()


# -- one worker process -----------------------------------------------------------------------------
def worker_main(cfg: Config) -> int:
    """Entry point of one worker process (under shardlab's launcher, torchrun, srun or a pod).
    Exit codes: 0 done, PREEMPTED_EXIT_CODE (75) a signal was turned into a checkpoint, 1 it lost
    its peers (said in one line; the traceback in <run dir>/debug/); other failures raise."""
    # the libraries' bars would go to stderr ([Note: progress for terminals and for logs] in measurements.py)
    quiet_library_bars()
    rt = start_runtime(cfg.parallel)
    clean = False
    try:
        if not cfg.output.run_name:  # the same on every rank: a function of the config
            cfg.output.run_name = default_run_name(cfg)
        result = train(cfg, rt)
        if rt.is_main and not isinstance(result, Finished):  # a finished run said so in one line
            print_summary(result, run_dir(cfg.output))
        clean = True
        return 0
    except Preempted as p:
        r = p.record  # an agent's stop, if elastic: the next group's line (loop/elastic.py)
        signalled = r["unix_time"] - (r["signal_to_exit_s"] or 0.0)  # None: another rank's signal
        elastic.note_end(run_dir(cfg.output), rt.rank, r["step"], "stopped", signalled)
        if rt.is_main:
            print(elastic.stop_line(r) if elastic.launched() else f"shardlab: {p}; exit code {PREEMPTED_EXIT_CODE}. "
                  "The same command (checkpoint.resume=auto) continues from it.", flush=True)
        return PREEMPTED_EXIT_CODE
    except BaseException as e:
        peer = doctor.is_peer_failure(e)
        if peer:  # elastic: the next group says what was lost (loop/elastic.py)
            elastic.note_end(run_dir(cfg.output), rt.rank, RECORDER.step - 1, "lost")
        kept = doctor.keep_traceback(e, run_dir(cfg.output), rt.rank) if cfg.output.run_name else None
        # a lost peer: its traceback only in that file ([Note: a lost peer's traceback] in doctor/worker.py)
        quiet = peer and rt.distributed and kept is not None and not doctor.prints_tracebacks(run_dir(cfg.output))
        # says "lost contact" if a peer died or hung; the exit record and others' stacks in <run dir>/debug
        doctor.worker_failed(e, rt.rank, rt.distributed, cfg.parallel.timeout_s, kept if quiet else None)
        _record_for_agent(e)
        if quiet:
            return 1
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
