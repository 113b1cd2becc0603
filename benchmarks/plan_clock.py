"""plan's clock checked here: `shardlab plan --gpu cpu` against `shardlab train` of the same config on
this machine, per model preset, engine and world size (docs/plan.md, "Step time, checked").

    OMP_NUM_THREADS=1 nice -n -15 .venv/bin/python benchmarks/plan_clock.py [--presets gpt-tiny,gpt-mini] \
        [--nproc 1,2,4] [--engines ddp,zero3,fsdp,torch-ddp,torch-fsdp] [--steps 12] [--warmup 2] [--repeats 1] \
        [--out plan_clock.json]

Per preset and world size: one `shardlab plan --json` for every engine (its predicted `step_s`), then
one `shardlab train` per engine, measured by bench's method (shardlab/bench.py): 12 steps a run, the first 2
left out, the median over the rest (metrics.json's `step_times_s`; with `--repeats`, over the measured steps of
every repeat together, as bench pools its rounds). Prints a markdown table with the load average beside each row: on a busy machine both sides move.
Not a test: the defaults (the clock's check: every engine at 1, 2 and 4 ranks on gpt-tiny and gpt-mini) take
about ten minutes on the idle 2-core VM, and it prints the wall time it took. Run it with OMP_NUM_THREADS=1:
plan and the runs then use the same threads per rank, and no OpenMP thread spins waiting for a descheduled
sibling. plan predicts the idle machine's step (its rates are measured in CPU time, plan/cpu.py), so on a
busy machine the measured step is slower by the share of the cores the run gets: the load column says how
busy it was; `nice -n -15` (as root) gives the runs a larger share. With `--repeats N` each preset and world
size is planned and run N times in turn, and a row gives the plans' median, the median of every repeat's measured
steps together, and each repeat's ratio (its plan over its run's median): on this VM, whose
speed moves by up to 10 % from one run to the next, that is the steadier check (N times as long).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARDLAB = [sys.executable, "-m", "shardlab"]
CONFIG = str(ROOT / "configs" / "gpt-tiny.yaml")


def _overrides(preset: str, steps: int) -> list[str]:
    return [f"model.preset={preset}", f"train.steps={steps}", "train.eval_every=0", "checkpoint.every_steps=0",
            "output.tensorboard=false", "output.progress=false"]


def planned(preset: str, engines: list[str], nproc: int, steps: int) -> dict[str, float]:
    cmd = [*SHARDLAB, "plan", CONFIG, *_overrides(preset, steps), "--gpu", "cpu", "--nproc", str(nproc),
           "--engines", ",".join(engines), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    report = json.loads(out)
    return {e: r["time"]["step_s"] for e, r in report["engines"].items()}


def measured(preset: str, engine: str, nproc: int, steps: int, warmup: int, out_dir: str, repeat: int = 0) -> list[float]:
    """The run's step times after its first `warmup` steps (rank 0's, as metrics.json gives them)."""
    name = f"{preset}-{engine}-{nproc}-{repeat}"
    cmd = [*SHARDLAB, "train", CONFIG, *_overrides(preset, steps), f"parallel.strategy={engine}",
           f"output.dir={out_dir}", f"output.run_name={name}", "checkpoint.resume=none"]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads((Path(out_dir) / name / "metrics.json").read_text())["step_times_s"][warmup:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="gpt-tiny,gpt-mini")
    p.add_argument("--nproc", default="1,2,4")
    p.add_argument("--engines", default="ddp,zero3,fsdp,torch-ddp,torch-fsdp",
                   help="distributed engines (at 1 rank `single` is added)")
    p.add_argument("--steps", type=int, default=12, help="steps per run, warmup included (bench's default)")
    p.add_argument("--warmup", type=int, default=2, help="steps per run left out of the median (bench's default)")
    p.add_argument("--repeats", type=int, default=1,
                   help="plan and run each row this many times, in turn (plan, the runs, plan, the runs, ...): "
                        "a row's planned figure is the plans' median, its measured one the median of every "
                        "repeat's measured steps together")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be >= 0 and smaller than --steps ({args.steps}), got {args.warmup}")
    rows, started = [], time.time()
    each = " | ratio of each repeat" if args.repeats > 1 else ""
    print(f"| preset | engine | ranks | planned ms | measured ms | planned / measured{each} | load (1 min) |")
    print("|---|---|---|---|---|---|---|" + ("---|" if each else ""))
    with tempfile.TemporaryDirectory(prefix="plan-clock-") as tmp:
        for preset in args.presets.split(","):
            for nproc in (int(n) for n in args.nproc.split(",")):
                engines = (["single"] if nproc == 1 else []) + args.engines.split(",")
                plans: dict[str, list[float]] = {e: [] for e in engines}
                runs: dict[str, list[list[float]]] = {e: [] for e in engines}
                loads: dict[str, list[float]] = {e: [] for e in engines}
                t0 = time.time()
                for repeat in range(args.repeats):
                    for engine, planned_s in planned(preset, engines, nproc, args.steps).items():
                        plans[engine].append(planned_s)
                    for engine in engines:
                        runs[engine].append(measured(preset, engine, nproc, args.steps, args.warmup, tmp, repeat))
                        loads[engine].append(os.getloadavg()[0])
                for engine in engines:
                    each_run = [statistics.median(steps) for steps in runs[engine]]
                    plan, got = statistics.median(plans[engine]), statistics.median([t for r in runs[engine] for t in r])
                    row = {"preset": preset, "engine": engine, "nproc": nproc, "planned_s": plan, "measured_s": got,
                           "ratio": plan / got, "load_1min": max(loads[engine]),
                           "planned_each_s": plans[engine], "measured_each_s": each_run,
                           "run_s": (time.time() - t0) / len(engines)}
                    rows.append(row)
                    ratios = " | " + ", ".join(f"{a / b:.2f}" for a, b in zip(plans[engine], each_run)) if each else ""
                    print(f"| {preset} | {engine} | {nproc} | {plan * 1e3:.1f} | {got * 1e3:.1f} | "
                          f"{row['ratio']:.2f}{ratios} | {row['load_1min']:.1f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    ratios = [r["ratio"] for r in rows]
    print(f"\nplanned / measured {min(ratios):.2f}-{max(ratios):.2f} over {len(rows)} rows"
          + (f" (medians of {args.repeats} repeats)" if args.repeats > 1 else "")
          + f", {(time.time() - started) / 60:.1f} min, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
