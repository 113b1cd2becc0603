"""What the hang doctor costs (docs/benchmarks.md, "Hang doctor overhead"). A script:

    python -m tests.doctor_overhead --strategies fsdp,torch-fsdp --rounds 3 --steps 10

1. Per call, in this process: a collective's record (issue + complete), a phase mark, a step
   mark, and the unit-label hooks on a unit's forward, each doctor on and off (timeit, best of 5);
   per step, the step summary ([Note: the step summaries] in doctor/flight.py): a step of
   SUMMARY_STEP collectives and phase marks recorded with the summaries on and off.
2. Per step: `shardlab train --nproc 2` of gpt-mini on synthetic tokens (bench's settings),
   doctor.enabled=true and false alternated in each round (the order flips every round), step
   times from metrics.json without the warm-up steps; the median of all measured steps of all
   rounds per arm, their ratio, and the calls one step makes (read from the run's flight file)
   times their cost per call: the overhead the per-call figures predict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit

SUMMARY_STEP = (20, 10)     # the collectives and phase marks of the step whose summary is timed


def per_call_costs(tmp: str) -> dict[str, float]:
    """Microseconds per call, doctor on (a mapped flight file) and off (recorder closed)."""
    import torch
    from torch import nn

    from shardlab import doctor
    from shardlab.doctor.flight import FlightRecorder
    from shardlab.doctor.worker import _enter_unit, _leave_unit

    rec = FlightRecorder()
    rec.describe_group = lambda g: ("0", [0, 1])
    out: dict[str, float] = {}

    def best(stmt, n: int) -> float:
        return min(timeit.repeat(stmt, number=n, repeat=5)) / n * 1e6

    def record():
        rec.complete(rec.issue("all_gather", 4096, None))

    def mark():
        with doctor.phase("forward"):
            pass

    unit = nn.Sequential(nn.Linear(8, 8))
    x = torch.randn(2, 8, requires_grad=True)

    def forward_backward():
        unit(x).sum().backward()

    plain = best(forward_backward, 2000)
    for state in ("on", "off"):
        if state == "on":
            rec.open(os.path.join(tmp, "bench.flight"), rank=0, world=2, attempt=0)
        out[f"collective record ({state})"] = best(record, 100_000)
        doctor.RECORDER.open(os.path.join(tmp, "bench2.flight"), rank=0, world=2, attempt=0) if state == "on" \
            else doctor.RECORDER.close()
        out[f"phase mark ({state})"] = best(mark, 100_000)
        out[f"step mark ({state})"] = best(lambda: doctor.RECORDER.set_step(3), 100_000)
        rec.close()
    step_time = {}
    for summaries in (True, False):
        rec.open(os.path.join(tmp, "bench3.flight"), rank=0, world=2, attempt=0, summaries=summaries)

        def step():
            rec.set_step(rec.step + 1)   # the previous step's summary is written here
            for _ in range(SUMMARY_STEP[1]):
                rec.enter_phase("forward")
            for _ in range(SUMMARY_STEP[0]):
                rec.complete(rec.issue("all_gather", 4096, None))

        step_time[summaries] = best(step, 20_000)
        rec.close()
    calls, marks = SUMMARY_STEP
    out[f"step summary (on), per step of {calls} collectives and {marks} marks"] = step_time[True] - step_time[False]
    doctor.RECORDER.open(os.path.join(tmp, "bench2.flight"), rank=0, world=2, attempt=0)
    pre = unit.register_forward_pre_hook(lambda m, a: _enter_unit(0, m, a), prepend=True)
    post = unit.register_forward_hook(lambda m, a, o: _leave_unit(0, m, a, o))
    out["unit labels, per unit forward + backward (on)"] = best(forward_backward, 2000) - plain
    pre.remove()
    post.remove()
    doctor.RECORDER.close()
    return out


def _run(strategy: str, enabled: bool, steps: int, out: str, name: str) -> dict:
    cmd = [sys.executable, "-m", "shardlab", "train", "--nproc", "2", f"parallel.strategy={strategy}",
           "model.preset=gpt-mini", "data.source=synthetic", "data.seq_len=128", "data.synthetic_samples=512",
           "train.micro_batch_size=8", "train.global_batch_size=16", f"train.steps={steps}", "train.warmup_steps=0",
           "train.eval_batches=1", "train.memory_tracking=none", "output.tensorboard=false", "output.progress=false",
           f"doctor.enabled={str(enabled).lower()}", f"output.dir={out}", f"output.run_name={name}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(out, name, "metrics.json")) as f:
        return json.load(f)


def _calls_per_step(run_dir: str, step: int) -> int:
    from shardlab.doctor.flight import flight_path
    from shardlab.doctor.flight_read import read_flight

    return sum(e.step == step for e in read_flight(flight_path(os.path.join(run_dir, "debug"), 0)).entries)


def main() -> None:
    from shardlab.models import GPT_PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="fsdp,torch-fsdp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="doctor-overhead-") as tmp:
        costs = per_call_costs(tmp)
        print("| per call | µs |\n|---|---:|")
        for k, v in costs.items():
            print(f"| {k} | {v:.2f} |")
        print("\n| engine | step, doctor off (median s) | step, doctor on | on / off | collectives per step | "
              "predicted overhead |\n|---|---:|---:|---:|---:|---:|")
        for strategy in args.strategies.split(","):
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for enabled in ((True, False) if r % 2 == 0 else (False, True)):
                    m = _run(strategy, enabled, args.steps, tmp, f"{strategy}-{enabled}-{r}")
                    times[enabled] += m["step_times_s"][args.warmup:]
            on, off = statistics.median(times[True]), statistics.median(times[False])
            calls = _calls_per_step(os.path.join(tmp, f"{strategy}-True-0"), args.steps // 2)
            # one micro batch per rank and step (16 = 2 ranks x 8): data, forward, backward and
            # optimizer phase marks and a step mark; gpt-mini's units, each forward and backward once
            units = GPT_PRESETS["gpt-mini"].n_layer
            summary = next(v for k, v in costs.items() if k.startswith("step summary (on)"))
            predicted = (calls * costs["collective record (on)"] + 4 * costs["phase mark (on)"]
                         + costs["step mark (on)"] + units * costs["unit labels, per unit forward + backward (on)"]
                         + summary) / 1e6 / off
            print(f"| {strategy} | {off:.3f} | {on:.3f} | {on / off:.3f} | {calls} | {100 * predicted:.3f} % |",
                  flush=True)


if __name__ == "__main__":
    main()
