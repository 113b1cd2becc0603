"""The loop's one measurements object: what each step measured, as MFU, as a line of
`<run dir>/steps.jsonl`, and as scalars for the trackers (trackers.py). Rank 0 keeps it; the
other ranks' object does nothing. The loop calls four things (train.py, `StepLogger` and
`_train`): `count_flops()` around a step, `step(...)` after it, `scalar(...)` for a validation
loss, `summary(step_times)` for metrics.json, and `close()`.

[Note: how MFU is computed]
FLOPs: the first step this run trains is counted on rank 0 as it runs (`CountFlops`, the
counter plan's probes use: every matmul, convolution and attention kernel the step dispatches,
by torch's formulas, recomputation included). Per token: that count over the token positions of
rank 0's share of the global batch (samples x tokens per sample, padding included: the
kernels compute them). Every step of a run has the same shapes, so the count holds for each.
MFU of a step = FLOPs of one rank's step / the step's wall time / one device's peak
(flops.device_peak) = FLOPs per token x global tokens/s / (world x peak), torchtitan's
formula with executed FLOPs in place of its 6N + 12 L H Q T model FLOPs: the same without
activation checkpointing, more by the recomputed forward with it (docs/observability.md). Under
`train.compile` the compiled kernels do not pass through the dispatcher: nothing is counted and
MFU is null, with the reason in metrics.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from shardlab.config import dump_config
from shardlab.observe.trackers import open_trackers, resolve_trackers

STEPS_FILE = "steps.jsonl"


def step_tokens(run: Any, step_index: int) -> int | None:
    """Tokens of the global batch of step `step_index` (0-based): its samples' real tokens where
    the data says (padding excluded), else samples x tokens per sample; None for other data."""
    if run.data.real_tokens is not None:
        return int(run.data.real_tokens[run.sampler.rank_indices(step_index, 0, 1)].sum())
    if run.data.tokens_per_sample:
        return run.cfg.train.global_batch_size * run.data.tokens_per_sample
    return None


class Measurements:
    def __init__(self, run: Any):
        cfg, rt = run.cfg, run.rt
        self.run, self.main = run, rt.is_main
        self.samples_rank = cfg.train.global_batch_size // rt.world_size
        self.step_flops: int | None = None
        self.peak: float | None = None
        self.peak_source = ""
        self.note = "trains nothing in this run" if run.state.step >= cfg.train.steps else None
        if cfg.train.compile:
            self.note = "not counted under train.compile: compiled kernels bypass the dispatcher that counts FLOPs"
        self.trackers: list = []
        self.lines = None
        if not self.main:
            return
        os.makedirs(run.out_dir, exist_ok=True)
        self.lines = open(os.path.join(run.out_dir, STEPS_FILE), "a", buffering=1)
        self._write({"event": "start", "attempt": rt.restart_count, "world": rt.world_size, "step": run.state.step,
                     "launch": os.environ.get("TORCHELASTIC_RUN_ID")})
        self.trackers = open_trackers(resolve_trackers(cfg.output), run.out_dir, cfg.output.run_name or "run",
                                      cfg.to_dict(), dump_config(cfg))

    @contextlib.contextmanager
    def count_flops(self) -> Iterator[None]:
        """Around a training step: the first this run trains is counted (rank 0)."""
        if not self.main or self.step_flops is not None or self.note is not None:
            yield
            return
        from shardlab.observe.flops import CountFlops, device_peak

        self.peak, self.peak_source = device_peak(self.run.rt.device, self.run.cfg.train.precision)
        with CountFlops() as counted:
            yield
        self.step_flops = counted.flops

    def mfu(self, step_time: float) -> float | None:
        if self.step_flops is None or not self.peak or step_time <= 0:
            return None
        return self.step_flops / step_time / self.peak

    def step(self, r: Any, step_time: float) -> dict[str, Any]:
        """After step `run.state.step` (1-based) trained in `step_time` s: its record, written to
        steps.jsonl and the trackers every `train.log_every` steps; returned for the progress bar."""
        run = self.run
        step, t = run.state.step, run.cfg.train
        tokens = step_tokens(run, step - 1)
        rec: dict[str, Any] = {"step": step, "loss": r.loss, "lr": run.sched.get_last_lr()[0],
                               "grad_norm": r.grad_norm, "step_time_s": step_time,
                               "samples_per_s": t.global_batch_size / step_time,
                               "tokens_per_s": tokens / step_time if tokens else None, "mfu": self.mfu(step_time),
                               "data_wait_s": run.batches.wait_s.get(step - 1) if run.batches else None,
                               "skipped": r.skipped, "attempt": run.rt.restart_count}
        if run.scaler is not None:
            rec["loss_scale"] = run.scaler.get_scale()
        if self.main and step % t.log_every == 0:
            self._write(rec)
            self._track({"train/loss": r.loss, "train/lr": rec["lr"], "train/grad_norm": r.grad_norm,
                         "perf/samples_per_s": rec["samples_per_s"], "perf/tokens_per_s": rec["tokens_per_s"],
                         "perf/mfu": rec["mfu"], "train/loss_scale": rec.get("loss_scale")}, step)
        return rec

    def scalar(self, tag: str, value: float | None, step: int) -> None:
        """A scalar outside the step's (the validation loss: tag "val/loss")."""
        if self.main and value is not None:
            self._write({"step": step, tag.replace("/", "_"): value, "attempt": self.run.rt.restart_count})
            self._track({tag: value}, step)

    def summary(self, step_times: list[float]) -> dict[str, Any]:
        """metrics.json's MFU keys: per step of this run (as step_times_s), their median over the
        steps after the first (as step_time_median_s), and what they come from."""
        per_step = [self.mfu(s) for s in step_times]
        measured = [m for m in per_step[1:] or per_step if m is not None]
        tokens = self.run.data.tokens_per_sample
        flops_sample = self.step_flops / self.samples_rank if self.step_flops is not None else None
        return {"mfu": statistics.median(measured) if measured else None,
                "mfu_per_step": per_step if self.step_flops is not None else None,
                "flops_per_step_per_rank": self.step_flops,
                "flops_per_sample": flops_sample,
                "flops_per_token": flops_sample / tokens if flops_sample is not None and tokens else None,
                "peak_flops_per_s": self.peak, "peak_flops_source": self.peak_source or None,
                "mfu_note": self.note}

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.lines is not None:
            self.lines.close()
            self.lines = None

    def _write(self, record: dict[str, Any]) -> None:
        if self.lines is not None:
            self.lines.write(json.dumps({"time": time.time(), **record}) + "\n")

    def _track(self, scalars: dict[str, float | None], step: int) -> None:
        present = {k: float(v) for k, v in scalars.items() if v is not None}
        for tracker in self.trackers:
            tracker.log(present, step)
