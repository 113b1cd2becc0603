"""Measure `peak_live_bytes` the way `shardlab train` does, in-process: one spawn per world
size runs `shardlab.loop.train.train` for every engine in turn (same code path as the CLI, minus the
launcher), with `train.memory_tracking=last`, each engine's config as plan plans it
(`plan.model.engine_config`: e.g. `parallel.accumulate=sharded` runs ddp with local). Used by tests/test_plan.py and, as a script,
to print plan's agreement table:

    python -m tests.plan_measure configs/gpt-tiny.yaml [key=value ...] --nproc 1,2,4
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

ENGINES_DISTRIBUTED = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")


def _measure_worker(rank: int, world: int, config: str | None, overrides: list[str], engines: list[str],
                    out_dir: str) -> dict[str, Any]:
    import torch

    from shardlab.config import load_config
    from shardlab.loop.runtime import Runtime
    from shardlab.loop.train import train
    from shardlab.plan.model import engine_config

    out: dict[str, Any] = {}
    for engine in engines:
        # no checkpoint, not even the final one (a Llama of 7 x 320 writes 122 MiB per engine): the
        # peak is the tracked last step's, the save comes after it
        cfg = load_config(config, [*overrides, "train.memory_tracking=last",
                                   "output.tensorboard=false", "output.progress=false", "checkpoint.resume=none",
                                   "checkpoint.every_steps=0", "checkpoint.final=false", "train.eval_batches=1",
                                   f"output.dir={out_dir}", f"output.run_name={engine}-{world}"])
        cfg = engine_config(cfg, engine, world)  # as plan plans it: options the engine does not take dropped
        rt = Runtime(rank, rank, world, torch.device("cpu"), "gloo")
        result = train(cfg, rt)
        out[engine] = {"peak_live_bytes": max(result["peak_live_bytes"]),
                       "peak_breakdown": result["peak_breakdown"][result["peak_live_bytes"].index(
                           max(result["peak_live_bytes"]))],
                       "step_time_median_s": result["step_time_median_s"]}
    return out


def measure(config: str | None, overrides: list[str], world: int, engines: list[str] | None = None,
            timeout_s: float = 600.0) -> dict[str, dict[str, Any]]:
    """engine -> {peak_live_bytes (max over ranks), peak_breakdown (of that rank)} at world size `world`."""
    from shardlab.testing import run_workers

    if engines is None:
        engines = (["single"] if world == 1 else []) + list(ENGINES_DISTRIBUTED)
    with tempfile.TemporaryDirectory(prefix="shardlab-plan-measure-") as tmp:
        return run_workers(world, _measure_worker, config, list(overrides), list(engines), tmp,
                           timeout_s=timeout_s)[0]


def main() -> None:
    from shardlab.config import load_config
    from shardlab.plan import predict_all

    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--nproc", default="1,2,4")
    ap.add_argument("--engines", default=None)
    ap.add_argument("--breakdown", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for n in [int(x) for x in a.nproc.split(",")]:
        engines = a.engines.split(",") if a.engines else None
        measured = measure(a.config, a.overrides, n, engines)
        predicted = predict_all(load_config(a.config, a.overrides), n, list(measured))
        for engine, m in measured.items():
            p = predicted[engine]
            err = (p.peak_bytes - m["peak_live_bytes"]) / m["peak_live_bytes"]
            rows.append((engine, n, p.peak_bytes, m["peak_live_bytes"], err))
            print(f"| {engine} | {n} | {p.peak_bytes / 2**20:.2f} | {m['peak_live_bytes'] / 2**20:.2f} | "
                  f"{100 * err:+.1f}% | {m['peak_breakdown']['phase']} |", flush=True)
            if a.breakdown:
                print("   measured:", {k: round(v / 2**20, 2) for k, v in m["peak_breakdown"]["parts"].items()})
                print("   predicted:", {k: round(v / 2**20, 2) for k, v in p.parts.items()}, p.phase)


if __name__ == "__main__":
    main()
