"""The engine benchmark: every engine at every world size, measured through the real
`shardlab train` path, side by side with the theory.

Each cell is one `shardlab train --nproc N` run on synthetic tokens (no data loading
cost), whose metrics.json gives per-step times, model-state bytes per rank (exact tensor
byte counts of parameters + gradients + optimizer state, taken at the last step) and, for
shardlab's own engines, bytes per collective kind. Nothing in the tables is computed from
the formulas except the columns named "theory". Cells run in interleaved order over
`--repeats` rounds, so drift on a shared machine hits every engine alike; the reported
step time is the median over all measured steps of all rounds (warmup steps excluded).

  shardlab bench --strategies ddp,torch-ddp,fsdp,torch-fsdp,zero3 --nproc 2 --preset gpt-mini
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

BYTES_FP32 = 4


def _run_cell(args: argparse.Namespace, strategy: str, nproc: int, out_dir: str, tag: str) -> dict[str, Any]:
    name = f"{strategy}-n{nproc}-{tag}"
    cmd = [sys.executable, "-m", "shardlab", "train",
           f"model.preset={args.preset}", "data.source=synthetic", f"data.seq_len={args.seq_len}",
           f"data.synthetic_samples={max(256, args.micro_batch * nproc * (args.steps + 2))}",
           f"train.steps={args.steps}", f"train.micro_batch_size={args.micro_batch}",
           f"train.global_batch_size={args.micro_batch * nproc}", "train.optimizer=adamw", "train.warmup_steps=0",
           "train.eval_batches=1", f"parallel.strategy={strategy}", f"parallel.mixed_precision={args.mixed_precision}",
           "checkpoint.resume=none", "checkpoint.every_steps=0",
           f"output.dir={out_dir}", f"output.run_name={name}", "output.tensorboard=false", "output.progress=false"]
    if strategy != "single":
        cmd += ["--nproc", str(nproc)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} x{nproc} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, name, "metrics.json")) as f:
        m = json.load(f)
    m["process_wall_s"] = time.perf_counter() - t0
    return m


def _comm_per_step(m: dict[str, Any], field: str) -> float | None:
    """Mean over ranks of bytes per training step (metrics.json counts the training loop only)."""
    per_rank = [s for s in m["comm_bytes"] if s]
    if not per_rank:
        return None
    return sum(sum(kind[field] for kind in s.values()) for s in per_rank) / len(per_rank) / m["steps_this_run"]


def summarize(cells: dict[tuple[str, int], list[dict[str, Any]]], warmup: int) -> list[dict[str, Any]]:
    rows = []
    for (strategy, nproc), runs in cells.items():
        steps = [t for m in runs for t in m["step_times_s"][warmup:]]
        round_medians = [statistics.median(m["step_times_s"][warmup:]) for m in runs]
        m = runs[0]
        psi = m["num_parameters"]
        sharded = m["sharded"]
        median = statistics.median(steps)

        rows.append({
            "strategy": strategy, "world_size": nproc, "num_parameters": psi,
            "step_time_median_s": median, "measured_steps": len(steps),
            "round_medians_s": round_medians,
            # how far the rounds' medians disagree, relative to the overall median (0 with one round)
            "round_spread": (max(round_medians) - min(round_medians)) / median,
            "samples_per_s": m["samples_processed"] / m["steps_this_run"] / median,
            "tokens_per_s": m.get("tokens_processed", 0) / m["steps_this_run"] / median,
            "model_state_bytes_max_rank": max(m["model_state_bytes"]),
            "model_state_theory_bytes": 16 * psi / (nproc if sharded else 1),
            "sharded": sharded,
            "comm_payload_bytes_per_step": _comm_per_step(m, "payload_bytes"),
            "comm_bus_bytes_per_step": _comm_per_step(m, "bus_bytes"),
            # Sent per rank on a ring: all-reduce 2(N-1)/N x 4Psi; sharded 3 x (N-1)/N x 4Psi.
            "comm_bus_theory_bytes_per_step": 0 if strategy == "single" else
            (3 if sharded else 2) * (nproc - 1) / nproc * psi * BYTES_FP32,
            "peak_rss_bytes_max_rank": max(m["peak_memory_bytes"]),
            "final_loss": m["final_loss"],
        })
    return rows


def _speed_vs(twin: dict[str, Any], r: dict[str, Any]) -> str:
    """The speed ratio with the rounds' spread beside it; a ratio whose distance from 1 is
    smaller than the spread of either cell is not resolved, and says so."""
    ratio = twin["step_time_median_s"] / r["step_time_median_s"]
    if len(r["round_medians_s"]) < 2:
        return f"{ratio:.2f}x (1 round: spread unknown)"
    spread = max(r["round_spread"], twin["round_spread"])
    verdict = " within noise" if spread > abs(ratio - 1) else ""
    return f"{ratio:.2f}x (rounds ±{spread * 50:.0f}%{verdict})"


def to_markdown(rows: list[dict[str, Any]]) -> str:
    mib = 2**20
    head = ("| strategy | N | median step (ms) | samples/s | speed vs torch twin | model state / rank (MiB) "
            "| theory (MiB) | vs ddp | sent / rank / step (MiB) | theory (MiB) | peak RSS / rank (GiB) |")
    lines = [head, "|" + "---|" * 11]
    from shardlab.engines import STRATEGIES

    twin = {name: entry.torch_twin for name, entry in STRATEGIES.items() if entry.torch_twin}
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    for r in rows:
        t = by.get((twin.get(r["strategy"], ""), r["world_size"]))
        d = by.get(("ddp", r["world_size"])) or by.get(("torch-ddp", r["world_size"]))
        speed = _speed_vs(t, r) if t else ""
        mem = f"{r['model_state_bytes_max_rank'] / d['model_state_bytes_max_rank']:.2f}x" if d else ""
        comm = "not counted" if r["comm_bus_bytes_per_step"] is None else f"{r['comm_bus_bytes_per_step'] / mib:.1f}"
        lines.append(f"| {r['strategy']} | {r['world_size']} | {r['step_time_median_s'] * 1000:.0f} | "
                     f"{r['samples_per_s']:.2f} | {speed} | {r['model_state_bytes_max_rank'] / mib:.1f} | "
                     f"{r['model_state_theory_bytes'] / mib:.1f} | {mem} | {comm} | "
                     f"{r['comm_bus_theory_bytes_per_step'] / mib:.1f} | {r['peak_rss_bytes_max_rank'] / 2**30:.2f} |")
    return "\n".join(lines) + (
        "\n'sent' is what one rank sends per training step on a ring (nccl-tests' bus bytes), counted by "
        "shardlab.engines.collectives; PyTorch's engines are not instrumented. Theory: 16 bytes/param for DDP "
        "+ AdamW, 16/N sharded; 2(N-1)/N x 4 bytes/param (all-reduce) vs 3(N-1)/N x 4 bytes/param (sharded).\n")


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['strategy']}\nN={r['world_size']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(rows) * 2), 4))
    axes[0].bar(labels, [r["samples_per_s"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("samples / s (median step)")
    axes[1].bar(labels, [r["model_state_bytes_max_rank"] / 2**20 for r in rows], color="tab:orange", label="measured")
    axes[1].plot(labels, [r["model_state_theory_bytes"] / 2**20 for r in rows], "k_", markersize=20, label="theory")
    axes[1].set_ylabel("params + grads + AdamW state per rank (MiB)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardlab bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategies", default="ddp,torch-ddp,fsdp,torch-fsdp,zero3",
                   help="comma-separated engines (default: %(default)s)")
    p.add_argument("--nproc", default="2", help="comma-separated world sizes (default: %(default)s)")
    p.add_argument("--preset", default="gpt-mini", help="GPT preset (default: %(default)s, ~10.8M parameters)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="steps per run, warmup included")
    p.add_argument("--warmup", type=int, default=2, help="steps per run excluded from the median")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds over all cells")
    p.add_argument("--mixed-precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="output folder (default: runs/bench-<timestamp>)")


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The strategies and world sizes, or a ValueError that says what to fix (before any run)."""
    from shardlab.config import STRATEGY_CHOICES
    from shardlab.models import GPT_PRESETS

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGY_CHOICES]
    if bad or not strategies:
        raise ValueError(f"unknown strategies {bad}; valid: {', '.join(STRATEGY_CHOICES)}")
    try:
        worlds = [int(n) for n in str(args.nproc).split(",")]
    except ValueError:
        raise ValueError(f"--nproc takes comma-separated whole numbers, e.g. 1,2,4; got {args.nproc!r}") from None
    if any(n < 1 for n in worlds):
        raise ValueError(f"--nproc values must be >= 1, got {args.nproc}")
    if args.preset not in GPT_PRESETS:
        raise ValueError(f"unknown --preset {args.preset!r}; valid: {', '.join(GPT_PRESETS)}")
    for name in ("micro_batch", "seq_len", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup must be >= 0 and smaller than --steps ({args.steps}), got {args.warmup}")
    return strategies, worlds


def run(args: argparse.Namespace) -> int:
    try:
        strategies, worlds = check_arguments(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    order = [(s, n) for n in worlds for s in strategies if not (s == "single" and n != 1)]
    for rep in range(args.repeats):
        for s, n in order:
            print(f"[round {rep + 1}/{args.repeats}] {s} x{n} ...", flush=True)
            cells.setdefault((s, n), []).append(_run_cell(args, s, n, out, f"r{rep}"))
    rows = summarize(cells, args.warmup)
    table = to_markdown(rows)
    import platform

    import torch

    header = (f"shardlab bench, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n"
              f"command: shardlab bench {' '.join(sys.argv[2:] if sys.argv[1:2] == ['bench'] else sys.argv[1:])}\n"
              f"model: GPT {args.preset} ({rows[0]['num_parameters'] / 1e6:.2f}M params), micro batch {args.micro_batch}, "
              f"seq {args.seq_len}, AdamW fp32 state, {args.steps} steps x {args.repeats} round(s), "
              f"{args.warmup} warmup steps per run excluded\n")
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if not callable(v)}, "rows": rows}, f, indent=2)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(header + "\n" + table)
    plotted = plot(rows, os.path.join(out, "bench.png"))
    print(header)
    print(table)
    print(f"results: {out}/bench.md, bench.json" + (", bench.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
