"""`shardlab bench`'s cells: which to run (`plan_cells`: an engine's own axes, the cells it cannot
run skipped with their reason) and running one (`run_cell`: one `shardlab train` whose
metrics.json and flight records it reads back). The table they make: bench_table.py; the
command: bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from shardlab.config import load_config, strategies_taking
from shardlab.doctor.flight import APART
from shardlab.engines import engine_class
from shardlab.engines.collectives import resolve_shard_size
from shardlab.observe.runs import NotARun, attempt_splits, read_run

TRAIN_AXES = ("activation_checkpointing", "compile", "loss")
#: axes that are part of another engine option: parallel.reduce_dtype reaches the engine inside its
#: mixed-precision policy (config.engine_options), so the engines taking that take it
OPTION_OF_AXIS = {"reduce_dtype": "mixed_precision"}


def takes_axis(accepted: tuple[str, ...], key: str) -> bool:
    """Whether an engine with these options has `key` as an axis of its own (else it runs once)."""
    return key in TRAIN_AXES or key in accepted or OPTION_OF_AXIS.get(key) in accepted


def axis_key(key: str) -> str:
    return f"{'train' if key in TRAIN_AXES else 'parallel'}.{key}"


def cell_overrides(args: argparse.Namespace, strategy: str, nproc: int, variant: dict[str, str]) -> list[str]:
    """What bench sets on top of the config: the engine, the world, the step count, and no
    checkpoints, TensorBoard or progress bar (they would cost time inside the steps)."""
    micro = args.micro_batch
    out = []
    if args.config is None:  # the GPT shortcut
        micro = micro or 8
        out += [f"model.preset={args.preset}", "data.source=synthetic", f"data.seq_len={args.seq_len}",
                f"data.synthetic_samples={max(256, micro * nproc * args.micro_batches * (args.steps + 2))}",
                "train.optimizer=adamw"]
    out += list(args.overrides)
    if micro is not None:
        out += [f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * nproc * args.micro_batches}"]
    out += [f"train.steps={args.steps}", "train.warmup_steps=0", "train.eval_batches=1",
            f"parallel.strategy={strategy}", *(f"{axis_key(k)}={v}" for k, v in variant.items()),
            "checkpoint.resume=none", "checkpoint.every_steps=0", "checkpoint.final=false", "output.tensorboard=false",
            "output.trackers=[]", "output.progress=false"]
    return out


def weak_scaling_micro_batch(args: argparse.Namespace) -> None:
    """With a config and no --micro-batch: keep its micro batch per rank at every N."""
    if args.config is not None and args.micro_batch is None:
        args.micro_batch = load_config(args.config, args.overrides).train.micro_batch_size


def run_cell(args: argparse.Namespace, strategy: str, nproc: int, variant: dict[str, str], out_dir: str,
              tag: str) -> dict[str, Any]:
    label = "".join(f"-{k[:2]}{v}" for k, v in variant.items())
    name = f"{strategy}-n{nproc}{label}-{tag}"
    cmd = [sys.executable, "-m", "shardlab", "train", *([args.config] if args.config else []),
           *cell_overrides(args, strategy, nproc, variant), f"output.dir={out_dir}", f"output.run_name={name}"]
    if engine_class(strategy).distributed:
        cmd += ["--nproc", str(nproc)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} x{nproc} {variant} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, name, "metrics.json")) as f:
        m = json.load(f)
    with open(os.path.join(out_dir, name, "run_args.json")) as f:
        config = json.load(f)["config"]
    train, parallel = config["train"], config["parallel"]
    # bytes per parameter of params + grads + optimizer state, fp32: AdamW 4+4+8, SGD 4+4(+4 momentum)
    m["state_bytes_per_param"] = 16 if train["optimizer"] == "adamw" else 12 if train["momentum"] else 8
    m["shard_size"] = shard_size_of(strategy, nproc, parallel.get("shard_size"))
    m["offload"] = parallel.get("offload", "none")
    m["micro_batches"] = train["global_batch_size"] // (train["micro_batch_size"] * nproc)
    m["accumulate"] = parallel.get("accumulate", "local")
    m["process_wall_s"] = time.perf_counter() - t0
    m["comm_waited"] = waited_comm(os.path.join(out_dir, name))
    return m


def waited_comm(run_dir: str) -> dict[str, Any] | None:
    """What each step of a run waited on collectives, per rank, read back from its flight records
    ([Note: where a step's time goes] in observe/runs.py): `per_rank`, for each rank a list of
    (step, seconds waited, the step's seconds), and `unwaited`, the kinds with calls completed by a
    callback the rank never waited on (torch-ddp's buckets: DDP waits for them in C++, where the
    record cannot see, so that wait counts as compute). None when the run kept no flight records
    (doctor.enabled=false)."""
    try:
        attempts = read_run(run_dir).attempts
    except NotARun:
        return None
    splits = attempt_splits(attempts[-1]) if attempts else {}
    if not splits:
        return None
    a = attempts[-1]
    unwaited = sorted({e.kind for f in a.flights.values() for e in f.entries
                       if e.done and e.waited < 0 and e.phase not in APART})
    return {"per_rank": [[(s.step, s.parts["comm"], s.total) for s in splits.get(r, [])] for r in range(a.world)],
            "unwaited": unwaited}


def shard_size_of(strategy: str, nproc: int, configured: int | None) -> int:
    """S, the ranks a parameter is sharded over: parallel.shard_size for the hybrid engines (its
    default, the ranks per node, is N for bench's one-node runs), N for the other sharded engines,
    1 unsharded."""
    engine = engine_class(strategy)
    if not engine.grads_sharded:
        return 1
    if "shard_size" in engine.options and configured is not None:
        return int(configured)
    return nproc


def skip_reason(strategy: str, nproc: int, key: str, value: str, accepted: tuple[str, ...]) -> str | None:
    """Why an engine cannot run one axis value at N ranks, or None when it can."""
    if key == "offload" and value != "none" and key not in accepted:
        return (f"{strategy} has no offload (parallel.offload applies to {', '.join(strategies_taking('offload'))}); "
                f"its offload=none cell runs")
    if key == "shard_size" and key in accepted:
        try:
            resolve_shard_size(int(value), nproc)
        except ValueError as e:
            return str(e)
    return None


def plan_cells(strategies: list[str], worlds: list[int],
               variants: list[dict[str, str]]) -> tuple[list[tuple[str, int, dict[str, str]]], list[str]]:
    """The cells to run, in order, and the reasons for those skipped (one line each). An axis an
    engine does not take is not a variant of it (ddp runs once whatever --reshard-after-forward
    says), except a non-default offload, which it cannot honour: that cell is skipped."""
    order: list[tuple[str, int, dict[str, str]]] = []
    skipped: list[str] = []
    for n in worlds:
        for s in strategies:
            if not engine_class(s).distributed and n != 1:
                continue
            accepted = engine_class(s).options
            own: list[tuple[tuple[str, str], ...]] = []
            for v in variants:
                reasons = [(k, x, skip_reason(s, n, k, x, accepted)) for k, x in v.items()]
                reasons = [(k, x, why) for k, x, why in reasons if why]
                if reasons:
                    for k, x, why in reasons:
                        line = f"{s} x{n} {k}={x}: {why}"
                        if line not in skipped:
                            skipped.append(line)
                    continue
                cell = tuple((k, x) for k, x in v.items() if takes_axis(accepted, k))
                if cell not in own:
                    own.append(cell)
            order += [(s, n, dict(c)) for c in own]
    return order, skipped
