"""The engine benchmark: every engine at every world size, measured through the real
`shardlab train` path, side by side with the theory.

Each cell is one `shardlab train --nproc N` run whose metrics.json gives per-step times,
model-state bytes per rank (exact tensor byte counts of parameters + gradients + optimizer
state, taken at the last step), peak memory per rank (live tensor bytes where the run
reports them, and RSS / CUDA max allocated), bytes and calls per collective kind (every
engine: PyTorch's through DDP's comm hook and FSDP2's custom collectives), and two times:
what each step waited on collectives (from the hang doctor's flight record: part of the step)
and how long each kind's calls were in flight (overlapped with each other and with compute, so
not step time): [Note: the time a step waited on collectives] in bench_table.py. Nothing in
the tables is computed from the formulas except the columns named "theory". Cells run in interleaved order over `--repeats` rounds, so drift on a
shared machine hits every engine alike; the reported step time is the median over all
measured steps of all rounds (warmup steps excluded), with the 90th percentile beside it.

Without a config, a GPT preset on synthetic tokens (no data-loading cost). With one, that
config (and key=value overrides) as it is, with the per-rank micro batch held fixed so
each world size does the same work per rank (weak scaling):

  shardlab bench --strategies ddp,torch-ddp,fsdp,torch-fsdp,zero3 --nproc 2 --preset gpt-mini
  shardlab bench configs/resnet-cifar10.yaml data.source=synthetic --nproc 1,2,4 \\
      --strategies ddp,fsdp --reshard-after-forward true,false --mixed-precision fp32,bf16
  shardlab bench --strategies ddp,fsdp,torch-fsdp --nproc 4 --shard-size 2,4 --offload none,cpu
  shardlab bench --strategies single,fsdp --nproc 1,2 --activation-checkpointing none,selective,full \\
      --compile false,true

  shardlab bench --strategies fsdp,torch-fsdp --nproc 2 --loss chunked,full model.vocab_size=32000
  shardlab bench --strategies zero3,fsdp,torch-fsdp --nproc 2 --micro-batches 4 --accumulate local,sharded

--activation-checkpointing, --compile and --loss set train.* keys, which every engine takes.
A cell an engine cannot run (a shard size that does not divide N, offload for an engine
without it) is skipped with its reason, printed and kept in bench.json; an axis an engine does
not take at all (ddp and reshard_after_forward or shard_size) is not a variant of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardlab bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help="a train config (default: a GPT preset on synthetic tokens, see --preset)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the config, as for train")
    p.add_argument("--strategies", default=None,
                   help="comma-separated engines (default: every registered engine that runs on several processes)")
    p.add_argument("--nproc", default="2", help="comma-separated world sizes (default: %(default)s)")
    p.add_argument("--preset", default="gpt-mini", help="without a config: GPT preset (default: %(default)s)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="per-rank micro batch; the global batch is micro x N (default: 8, or the config's)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro batches per rank per step (gradient accumulation, k): the global batch is micro x N x k")
    p.add_argument("--seq-len", type=int, default=128, help="without a config: tokens per sample")
    p.add_argument("--steps", type=int, default=12, help="steps per run, warmup included")
    p.add_argument("--warmup", type=int, default=2, help="steps per run excluded from the median")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds over all cells")
    p.add_argument("--mixed-precision", default=None,
                   help="comma-separated axis of parallel.mixed_precision values, e.g. fp32,bf16")
    p.add_argument("--reduce-dtype", default=None,
                   help="comma-separated axis of parallel.reduce_dtype values: fp32,bf16,fp16 (the gradient "
                        "reductions' dtype; ddp, zero3, fsdp, torch-fsdp)")
    p.add_argument("--reshard-after-forward", default=None,
                   help="comma-separated axis of parallel.reshard_after_forward values: true,false "
                        "(FULL_SHARD vs SHARD_GRAD_OP)")
    p.add_argument("--shard-size", default=None,
                   help="comma-separated axis of parallel.shard_size values (HSDP: shard groups of S ranks, "
                        "replicated N/S times), e.g. 2,4; for fsdp and torch-fsdp; S not dividing N is skipped")
    p.add_argument("--offload", default=None,
                   help="comma-separated axis of parallel.offload values: none,cpu (fsdp, zero3, torch-fsdp; "
                        "cpu for another engine is skipped)")
    p.add_argument("--activation-checkpointing", default=None,
                   help="comma-separated axis of train.activation_checkpointing values: none,selective,full")
    p.add_argument("--compile", default=None,
                   help="comma-separated axis of train.compile values: false,true (torch.compile per block)")
    p.add_argument("--loss", default=None,
                   help="comma-separated axis of train.loss values: auto,chunked,full (the LM loss without whole logits)")
    p.add_argument("--accumulate", default=None,
                   help="comma-separated axis of parallel.accumulate values: local,sharded (with --micro-batches > 1: "
                        "the unsharded gradient summed until the last micro batch, or every micro batch reduced into "
                        "the shard; zero3, fsdp, torch-fsdp)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="output folder (default: runs/bench-<timestamp>)")


def _axis(value: str | None, key: str, choices: tuple[str, ...]) -> list[str]:
    if value is None:
        return []
    values = [v.strip().lower() for v in value.split(",") if v.strip()]
    bad = [v for v in values if v not in choices]
    if bad or not values:
        raise ValueError(f"--{key.replace('_', '-')} takes comma-separated values from {', '.join(choices)}; "
                         f"got {value!r}")
    return values


def _shard_size_axis(value: str | None) -> list[str]:
    if value is None:
        return []
    values = [v.strip() for v in value.split(",") if v.strip()]
    if not values or not all(v.isdigit() and int(v) >= 1 for v in values):
        raise ValueError(f"--shard-size takes comma-separated whole numbers >= 1 (parallel.shard_size), e.g. 2,4; "
                         f"got {value!r}")
    return [str(int(v)) for v in values]


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int], list[dict[str, str]]]:
    """The strategies, world sizes and variants, or a ValueError that says what to fix (before any run)."""
    from shardlab.bench_cells import TRAIN_AXES, axis_key
    from shardlab.config import ConfigError, load_config
    from shardlab.engines import STRATEGIES, engine_class
    from shardlab.models import GPT_PRESETS

    if args.config is not None and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.config)  # key=value given without a config
        args.config = None
    if args.strategies is None:
        args.strategies = ",".join(s for s in STRATEGIES if engine_class(s).distributed)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise ValueError(f"unknown strategies {bad}; valid: {', '.join(STRATEGIES)}")
    try:
        worlds = [int(n) for n in str(args.nproc).split(",")]
    except ValueError:
        raise ValueError(f"--nproc takes comma-separated whole numbers, e.g. 1,2,4; got {args.nproc!r}") from None
    if any(n < 1 for n in worlds):
        raise ValueError(f"--nproc values must be >= 1, got {args.nproc}")
    if args.config is None and args.preset not in GPT_PRESETS:
        raise ValueError(f"unknown --preset {args.preset!r}; valid: {', '.join(GPT_PRESETS)}")
    for name in ("seq_len", "steps", "repeats", "micro_batches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup must be >= 0 and smaller than --steps ({args.steps}), got {args.warmup}")
    variants: list[dict[str, str]] = [{}]
    for key, values in _axes(args).items():
        if values:
            variants = [{**v, key: value} for v in variants for value in values]
    try:  # the config and overrides themselves, with each train.* axis value, before any worker starts
        for v in variants:
            load_config(args.config, [*args.overrides, *(f"{axis_key(k)}={x}" for k, x in v.items() if k in TRAIN_AXES)])
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return strategies, worlds, variants


def _axes(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each axis's values (empty: not an axis of this run), or a ValueError naming the bad one."""
    from shardlab.engines.api import ACCUMULATE_MODES
    from shardlab.models.lm_loss import LOSS_MODES

    return {"mixed_precision": _axis(args.mixed_precision, "mixed_precision", ("fp32", "bf16", "fp16")),
            "reduce_dtype": _axis(args.reduce_dtype, "reduce_dtype", ("fp32", "bf16", "fp16")),
            "reshard_after_forward": _axis(args.reshard_after_forward, "reshard_after_forward", ("true", "false")),
            "shard_size": _shard_size_axis(args.shard_size),
            "offload": _axis(args.offload, "offload", ("none", "cpu")),
            "activation_checkpointing": _axis(args.activation_checkpointing, "activation_checkpointing",
                                              ("none", "selective", "full")),
            "compile": _axis(args.compile, "compile", ("false", "true")),
            "loss": _axis(args.loss, "loss", LOSS_MODES),
            "accumulate": _axis(args.accumulate, "accumulate", ACCUMULATE_MODES)}


def run(args: argparse.Namespace) -> int:
    from shardlab.bench_cells import plan_cells, run_cell, weak_scaling_micro_batch
    from shardlab.bench_table import summarize

    try:
        strategies, worlds, variants = check_arguments(args)
        weak_scaling_micro_batch(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    order, skipped = plan_cells(strategies, worlds, variants)
    for line in skipped:
        print(f"skipped: {line}", flush=True)
    if not order:
        print("error: every cell was skipped (reasons above); nothing to run", file=sys.stderr)
        return 2
    out = args.out or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        for s, n, v in order:
            label = ",".join(f"{k}={x}" for k, x in v.items())
            print(f"[round {rep + 1}/{args.repeats}] {s} x{n} {label}...", flush=True)
            cells.setdefault((s, n, label), []).append(run_cell(args, s, n, v, out, f"r{rep}"))
    _write_results(args, out, summarize(cells, args.warmup), skipped)
    return 0


def _write_results(args: argparse.Namespace, out: str, rows: list[dict[str, Any]], skipped: list[str]) -> None:
    """bench.json, bench.md and bench.png in `out`; the header and table printed."""
    import torch

    from shardlab.bench_table import plot, to_markdown

    table = to_markdown(rows)
    what = (f"config {args.config}" if args.config else f"GPT {args.preset}, seq {args.seq_len}, synthetic tokens")
    header = (f"shardlab bench, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n"
              f"command: shardlab bench {' '.join(sys.argv[2:] if sys.argv[1:2] == ['bench'] else sys.argv[1:])}\n"
              f"model: {what} ({rows[0]['num_parameters'] / 1e6:.2f}M params), micro batch {args.micro_batch or 8} "
              f"per rank x {args.micro_batches} micro batch(es) per step, {args.steps} steps x {args.repeats} round(s), "
              f"{args.warmup} warmup steps per run excluded\n")
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if not callable(v)}, "rows": rows,
                   "skipped": skipped}, f, indent=2)
    skipped_text = "".join(f"skipped: {line}\n" for line in skipped)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(header + "\n" + table + ("\n" + skipped_text if skipped else ""))
    plotted = plot(rows, os.path.join(out, "bench.png"))
    print(header)
    print(table)
    if skipped:
        print(skipped_text)
    print(f"results: {out}/bench.md, bench.json" + (", bench.png" if plotted else ""))


if __name__ == "__main__":
    sys.exit(main())
