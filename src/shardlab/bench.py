"""The engine benchmark: every engine at every world size, measured through the real
`shardlab train` path, side by side with the theory.

Each cell is one `shardlab train --nproc N` run whose metrics.json gives per-step times,
model-state bytes per rank (exact tensor byte counts of parameters + gradients + optimizer
state, taken at the last step), peak memory per rank (live tensor bytes where the run
reports them, and RSS / CUDA max allocated), and bytes, calls and time per collective kind
(every engine: PyTorch's through DDP's comm hook and FSDP2's custom collectives). The time
of a kind is per rank, the median over measured steps of the seconds that rank spent in that
kind's calls in one step, as the caller sees them: inside a blocking call, or from issue until
the wait on an async one returns. It includes waiting for the slowest rank, and for async
calls the compute overlapped before the wait, so it is not the exposed time (what the step
would save without communication); on CUDA with NCCL it times issue, not transfer
(docs/benchmarks.md). Nothing in the tables is computed from the formulas except the columns
named "theory". Cells run in interleaved order over `--repeats` rounds, so drift on a
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
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from shardlab.config import ConfigError, load_config, strategies_taking
from shardlab.engines import STRATEGIES, engine_class
from shardlab.engines.api import ACCUMULATE_MODES
from shardlab.engines.collectives import resolve_shard_size
from shardlab.models import GPT_PRESETS
from shardlab.models.lm_loss import LOSS_MODES

BYTES_FP32 = 4
#: Axes that set a `train.*` key, which every engine takes (the others are `parallel.*` engine options).
TRAIN_AXES = ("activation_checkpointing", "compile", "loss")
#: axes that are part of another engine option: parallel.reduce_dtype reaches the engine inside its
#: mixed-precision policy (config.engine_options), so the engines taking that take it
OPTION_OF_AXIS = {"reduce_dtype": "mixed_precision"}


def _takes(accepted: tuple[str, ...], key: str) -> bool:
    """Whether an engine with these options has `key` as an axis of its own (else it runs once)."""
    return key in TRAIN_AXES or key in accepted or OPTION_OF_AXIS.get(key) in accepted


def _axis_key(key: str) -> str:
    return f"{'train' if key in TRAIN_AXES else 'parallel'}.{key}"


def _cell_overrides(args: argparse.Namespace, strategy: str, nproc: int, variant: dict[str, str]) -> list[str]:
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
            f"parallel.strategy={strategy}", *(f"{_axis_key(k)}={v}" for k, v in variant.items()),
            "checkpoint.resume=none", "checkpoint.every_steps=0", "checkpoint.final=false", "output.tensorboard=false",
            "output.trackers=[]", "output.progress=false"]
    return out


def _weak_scaling_micro_batch(args: argparse.Namespace) -> None:
    """With a config and no --micro-batch: keep its micro batch per rank at every N."""
    if args.config is not None and args.micro_batch is None:
        args.micro_batch = load_config(args.config, args.overrides).train.micro_batch_size


def _run_cell(args: argparse.Namespace, strategy: str, nproc: int, variant: dict[str, str], out_dir: str,
              tag: str) -> dict[str, Any]:
    label = "".join(f"-{k[:2]}{v}" for k, v in variant.items())
    name = f"{strategy}-n{nproc}{label}-{tag}"
    cmd = [sys.executable, "-m", "shardlab", "train", *([args.config] if args.config else []),
           *_cell_overrides(args, strategy, nproc, variant), f"output.dir={out_dir}", f"output.run_name={name}"]
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
    m["shard_size"] = _shard_size(strategy, nproc, parallel.get("shard_size"))
    m["offload"] = parallel.get("offload", "none")
    m["micro_batches"] = train["global_batch_size"] // (train["micro_batch_size"] * nproc)
    m["accumulate"] = parallel.get("accumulate", "local")
    m["process_wall_s"] = time.perf_counter() - t0
    return m


def _shard_size(strategy: str, nproc: int, configured: int | None) -> int:
    """S, the ranks a parameter is sharded over: parallel.shard_size for the hybrid engines (its
    default, the ranks per node, is N for bench's one-node runs), N for the other sharded engines,
    1 unsharded."""
    engine = engine_class(strategy)
    if not engine.grads_sharded:
        return 1
    if "shard_size" in engine.options and configured is not None:
        return int(configured)
    return nproc


def comm_bus_theory(strategy: str, nproc: int, shard_size: int, sharded: bool, psi: int, k: int = 1,
                    accumulate: str = "local") -> float:
    """Bytes one rank sends per step on a ring, fp32 (docs/engines.md): all-reduce 2(N-1)/N x 4Psi
    unsharded; sharded over S of R = N/S replicas, all-gather twice within S per micro batch,
    2k(S-1)/S x 4Psi, and reduce-scatter within S, (S-1)/S x 4Psi, then the all-reduce of the 1/S
    slice across the R replicas, 2(R-1)/R x 4Psi/S (S = N: plain FSDP, no all-reduce; S = 1: DDP's
    all-reduce); with accumulate="sharded" the reductions once per micro batch, k times."""
    if nproc == 1:
        return 0.0
    if not sharded:
        return 2 * (nproc - 1) / nproc * psi * BYTES_FP32
    s, r = shard_size, nproc // shard_size
    reduces = k if accumulate == "sharded" else 1
    return (2 * k + reduces) * (s - 1) / s * psi * BYTES_FP32 + reduces * 2 * (r - 1) / r * psi * BYTES_FP32 / s


def _rank_seconds(m: dict[str, Any], rank: int, kind: str) -> list[float]:
    """One run's seconds per step of `kind` on `rank` (metrics.json comm_seconds_per_step)."""
    per_rank = m.get("comm_seconds_per_step") or []
    own = per_rank[rank] if rank < len(per_rank) else None
    return (own or {}).get(kind, [])


def _comm_by_kind(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per collective kind: calls and bus bytes per step (mean over ranks, from the first round)
    and seconds per step (per rank: the median over the measured steps of every round). Kinds
    without calls in the training steps are left out; a kind with calls and no time (FSDP2's HSDP
    all-reduce at S = 1, or a run that did not time) has None."""
    m = runs[0]
    steps = m["steps_this_run"]
    per_rank = [s for s in m["comm_bytes"] if s]
    if not per_rank:
        return {"calls": None, "bus_bytes": None, "seconds_per_rank": None, "seconds_max_rank": None}
    kinds = sorted({k for s in per_rank for k, t in s.items() if t["calls"]})
    calls = {k: sum(s.get(k, {}).get("calls", 0) for s in per_rank) / len(per_rank) / steps for k in kinds}
    bus = {k: sum(s.get(k, {}).get("bus_bytes", 0) for s in per_rank) / len(per_rank) / steps for k in kinds}
    seconds_per_rank = []
    for rank, own in enumerate(m["comm_bytes"]):
        mine = {}
        for k in kinds:
            if not (own or {}).get(k, {}).get("calls"):
                continue
            measured = [t for r in runs for t in _rank_seconds(r, rank, k)[warmup:]]
            mine[k] = statistics.median(measured) if measured else None
        seconds_per_rank.append(mine)
    seconds_max = {k: max((r[k] for r in seconds_per_rank if r.get(k) is not None), default=None) for k in kinds}
    return {"calls": calls, "bus_bytes": bus, "seconds_per_rank": seconds_per_rank, "seconds_max_rank": seconds_max}


def _comm_per_step(m: dict[str, Any], field: str) -> float | None:
    """Mean over ranks of bytes per training step (metrics.json counts the training loop only)."""
    per_rank = [s for s in m["comm_bytes"] if s]
    if not per_rank:
        return None
    return sum(sum(kind[field] for kind in s.values()) for s in per_rank) / len(per_rank) / m["steps_this_run"]


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def summarize(cells: dict[tuple, list[dict[str, Any]]], warmup: int) -> list[dict[str, Any]]:
    """cells: (strategy, world size[, variant label]) -> the metrics of each round."""
    rows = []
    for key, runs in cells.items():
        strategy, nproc = key[0], key[1]
        variant = key[2] if len(key) > 2 else ""
        steps = [t for m in runs for t in m["step_times_s"][warmup:]]
        round_medians = [statistics.median(m["step_times_s"][warmup:]) for m in runs]
        m = runs[0]
        psi = m["num_parameters"]
        sharded = m["sharded"]
        shard_size = m.get("shard_size") or (nproc if sharded else 1)
        comm = _comm_by_kind(runs, warmup)
        median = statistics.median(steps)
        live = [max(r["peak_live_bytes"]) for r in runs if r.get("peak_live_bytes")]
        compiled = [r["compile_s"] for r in runs if r.get("compile_s") is not None]
        rows.append({
            "strategy": strategy, "world_size": nproc, "variant": variant, "num_parameters": psi,
            "step_time_median_s": median, "step_time_p90_s": _p90(steps), "measured_steps": len(steps),
            "round_medians_s": round_medians,
            # how far the rounds' medians disagree, relative to the overall median (0 with one round)
            "round_spread": (max(round_medians) - min(round_medians)) / median,
            "samples_per_s": m["samples_processed"] / m["steps_this_run"] / median,
            "tokens_per_s": m.get("tokens_processed", 0) / m["steps_this_run"] / median,
            "model_state_bytes_max_rank": max(m["model_state_bytes"]),
            # 16 Psi / S: S = N plain sharding, the shard group with HSDP (with offload, on the host)
            "model_state_theory_bytes": m.get("state_bytes_per_param", 16) * psi / (shard_size if sharded else 1),
            "sharded": sharded, "shard_size": shard_size, "offload": m.get("offload", "none"),
            "comm_payload_bytes_per_step": _comm_per_step(m, "payload_bytes"),
            "comm_bus_bytes_per_step": _comm_per_step(m, "bus_bytes"),
            # Sent per rank on a ring: all-reduce 2(N-1)/N x 4Psi; sharded 3(S-1)/S x 4Psi + 2(R-1)/R x 4Psi/S.
            "comm_bus_theory_bytes_per_step": comm_bus_theory(strategy, nproc, shard_size, sharded, psi,
                                                              m.get("micro_batches", 1), m.get("accumulate", "local")),
            # per collective kind, per step: calls and bus bytes (mean over ranks); seconds as the
            # caller saw them, per rank the median over measured steps, and the largest rank's
            "comm_calls_per_step": comm["calls"], "comm_bus_bytes_per_step_by_kind": comm["bus_bytes"],
            "comm_seconds_per_step": comm["seconds_per_rank"],
            "comm_seconds_per_step_max_rank": comm["seconds_max_rank"],
            "peak_rss_bytes_max_rank": max(m["peak_memory_bytes"]),
            # live tensor bytes at the step's peak (the memory tracker), median over rounds
            "peak_live_bytes_max_rank": statistics.median(live) if live else None,
            "peak_breakdown": (m.get("peak_breakdown") or [None])[0],
            "final_loss": m["final_loss"], "device": m.get("device"),
            # torch.compile seconds of the run (train.compile), median over rounds
            "compile_s": statistics.median(compiled) if compiled else None,
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
    head = ("| strategy | N | variant | median step (ms) | p90 (ms) | samples/s | speed vs torch twin "
            "| model state / rank (MiB) | theory (MiB) | vs ddp | peak live / rank (MiB) | vs ddp "
            "| peak RSS / rank (GiB) | sent / rank / step (MiB) | theory (MiB) | comm ms / step, by kind (max rank) |")
    lines = [head, "|" + "---|" * 16]
    twin = {name: entry.torch_twin for name, entry in STRATEGIES.items() if entry.torch_twin}
    by = {(r["strategy"], r["world_size"], r["variant"]): r for r in rows}

    def cell(strategy: str, n: int, variant: str) -> dict[str, Any] | None:
        """The other engine's cell with the same settings, as far as it takes them."""
        if strategy not in STRATEGIES:
            return None
        accepted = engine_class(strategy).options
        own = ",".join(kv for kv in variant.split(",") if kv and _takes(accepted, kv.split("=")[0]))
        return by.get((strategy, n, own))

    # "vs ddp": the first replicated engine with a cell at the same settings
    replicated = [s for s in STRATEGIES if engine_class(s).distributed and not engine_class(s).grads_sharded]
    for r in rows:
        n, v = r["world_size"], r["variant"]
        t = cell(twin.get(r["strategy"], ""), n, v)
        d = next((c for c in (cell(s, n, v) for s in replicated) if c is not None), None)
        speed = _speed_vs(t, r) if t else ""
        mem = f"{r['model_state_bytes_max_rank'] / d['model_state_bytes_max_rank']:.2f}x" if d else ""
        live = "" if r["peak_live_bytes_max_rank"] is None else f"{r['peak_live_bytes_max_rank'] / mib:.1f}"
        live_vs = (f"{r['peak_live_bytes_max_rank'] / d['peak_live_bytes_max_rank']:.2f}x"
                   if live and d and d["peak_live_bytes_max_rank"] else "")
        comm = "not counted" if r["comm_bus_bytes_per_step"] is None else f"{r['comm_bus_bytes_per_step'] / mib:.1f}"
        state_theory = f"{r['model_state_theory_bytes'] / mib:.1f}" + (" on host" if _offloaded(r) else "")
        lines.append(f"| {r['strategy']} | {n} | {v or 'default'} | {r['step_time_median_s'] * 1000:.0f} | "
                     f"{r['step_time_p90_s'] * 1000:.0f} | {r['samples_per_s']:.2f} | {speed} | "
                     f"{r['model_state_bytes_max_rank'] / mib:.1f} | {state_theory} | {mem} | "
                     f"{live} | {live_vs} | {r['peak_rss_bytes_max_rank'] / 2**30:.2f} | {comm} | "
                     f"{r['comm_bus_theory_bytes_per_step'] / mib:.1f} | {_comm_ms(r)} |")
    notes = [
        "'sent' is what one rank sends per training step on a ring (nccl-tests' bus bytes), counted by "
        "shardlab.engines.collectives (PyTorch's engines: DDP's comm hook, FSDP2's custom collectives). Theory: "
        "16 bytes/param for DDP + AdamW (12 SGD with momentum, 8 without), /S sharded (S = shard group size: "
        "N, or parallel.shard_size with HSDP); 2(N-1)/N x 4 bytes/param (all-reduce) vs 3(S-1)/S x 4 + "
        "2(R-1)/R x 4/S bytes/param (sharded over S, all-reduced over R = N/S replicas). 'peak live' is the "
        "largest live-tensor total of a rank during a step (metrics.json peak_live_bytes).",
        "'comm ms / step': per kind (ag all-gather, rs reduce-scatter, ar all-reduce, bc broadcast, rd reduce), "
        "the milliseconds a rank spent in that kind's calls per step, summed over the calls, median over measured "
        "steps, largest rank: inside a blocking call, or from issue until the wait on an async one returns "
        "(torch-ddp's buckets: until the future completes). It includes waiting for the slowest rank and any "
        "compute overlapped before the wait, and calls in flight together each count in full, so it is not "
        "exposed time and can exceed the step; on CUDA with NCCL it times issue only (docs/benchmarks.md).",
    ]
    if any(_offloaded(r) for r in rows):
        notes.append("offload=cpu: the model state (theory 'on host') lives in host memory; the device holds only "
                     "transients (the gathered units, gradients in flight, activations). "
                     + ("On this CPU-only machine the device is the CPU, so measured memory (model state, peak "
                        "live, RSS) does not drop with offload; the saving shows only on a GPU."
                        if not any("cuda" in str(r.get("device", "")).lower() for r in rows) else ""))
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n" + _compile_table(rows, by)


def _compile_table(rows: list[dict[str, Any]], by: dict[tuple, dict[str, Any]]) -> str:
    """Compiled cells beside their eager twins (the same cell with compile=false)."""
    lines = []
    for r in rows:
        if r.get("compile_s") is None:
            continue
        eager = by.get((r["strategy"], r["world_size"], r["variant"].replace("compile=true", "compile=false")))
        vs = _speed_vs(eager, r) if eager else ""
        eager_ms = f"{eager['step_time_median_s'] * 1000:.0f}" if eager else ""
        lines.append(f"| {r['strategy']} | {r['world_size']} | {r['variant']} | {r['compile_s']:.1f} | {eager_ms} | "
                     f"{r['step_time_median_s'] * 1000:.0f} | {vs} |")
    if not lines:
        return ""
    return ("\n| strategy | N | variant | compile (s) | eager step (ms) | compiled step (ms) | speed vs eager |\n"
            + "|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
            "'compile (s)': torch.compile's own timers in the run (dynamo + inductor, forward and backward, the final "
            "evaluation's recompile included), median over rounds; it depends on inductor's on-disk cache "
            "(TORCHINDUCTOR_CACHE_DIR), warm after the first compiled run of a graph. Compiled runs track no live "
            "memory (docs/memory.md): their peak live is not measured.\n")


_KIND_ABBREV = {"all_gather": "ag", "reduce_scatter": "rs", "all_reduce": "ar", "broadcast": "bc", "reduce": "rd"}


def _offloaded(r: dict[str, Any]) -> bool:
    return str(r.get("offload", "none")) not in ("none", "None", "")


def _comm_ms(r: dict[str, Any]) -> str:
    """'ag 12.3, rs 4.5' from the row's per-kind seconds (largest rank); '' with no collectives."""
    seconds = r.get("comm_seconds_per_step_max_rank")
    if seconds is None:
        return "not counted" if r.get("comm_bus_bytes_per_step") is None else ""
    return ", ".join(f"{_KIND_ABBREV.get(k, k)} " + ("not timed" if t is None else f"{t * 1000:.1f}")
                     for k, t in seconds.items())


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    """Throughput and peak memory per rank against world size, one line per engine (and variant)."""
    try:  # optional (the `plot` extra), and heavy: imported only to draw
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(r["strategy"] + (f" {r['variant']}" if r["variant"] else ""), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["world_size"])
        ns = [r["world_size"] for r in rs]
        axes[0].plot(ns, [r["samples_per_s"] for r in rs], "o-", label=label)
        mem = [(r["peak_live_bytes_max_rank"] or r["peak_rss_bytes_max_rank"]) / 2**20 for r in rs]
        axes[1].plot(ns, mem, "o-", label=label)
    axes[0].set_ylabel("samples / s (median step)")
    live = all(r["peak_live_bytes_max_rank"] for r in rows)
    axes[1].set_ylabel(("peak live tensor" if live else "peak RSS") + " MiB per rank")
    for ax in axes:
        ax.set_xlabel("world size N")
        ax.set_xticks(sorted({r["world_size"] for r in rows}))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


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


def _skip_reason(strategy: str, nproc: int, key: str, value: str, accepted: tuple[str, ...]) -> str | None:
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
                reasons = [(k, x, _skip_reason(s, n, k, x, accepted)) for k, x in v.items()]
                reasons = [(k, x, why) for k, x, why in reasons if why]
                if reasons:
                    for k, x, why in reasons:
                        line = f"{s} x{n} {k}={x}: {why}"
                        if line not in skipped:
                            skipped.append(line)
                    continue
                cell = tuple((k, x) for k, x in v.items() if _takes(accepted, k))
                if cell not in own:
                    own.append(cell)
            order += [(s, n, dict(c)) for c in own]
    return order, skipped


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int], list[dict[str, str]]]:
    """The strategies, world sizes and variants, or a ValueError that says what to fix (before any run)."""
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
    axes = {"mixed_precision": _axis(args.mixed_precision, "mixed_precision", ("fp32", "bf16", "fp16")),
            "reduce_dtype": _axis(args.reduce_dtype, "reduce_dtype", ("fp32", "bf16", "fp16")),
            "reshard_after_forward": _axis(args.reshard_after_forward, "reshard_after_forward", ("true", "false")),
            "shard_size": _shard_size_axis(args.shard_size),
            "offload": _axis(args.offload, "offload", ("none", "cpu")),
            "activation_checkpointing": _axis(args.activation_checkpointing, "activation_checkpointing",
                                              ("none", "selective", "full")),
            "compile": _axis(args.compile, "compile", ("false", "true")),
            "loss": _axis(args.loss, "loss", LOSS_MODES),
            "accumulate": _axis(args.accumulate, "accumulate", ACCUMULATE_MODES)}
    variants: list[dict[str, str]] = [{}]
    for key, values in axes.items():
        if values:
            variants = [{**v, key: value} for v in variants for value in values]
    try:  # the config and overrides themselves, with each train.* axis value, before any worker starts
        for v in variants:
            load_config(args.config, [*args.overrides, *(f"{_axis_key(k)}={x}" for k, x in v.items() if k in TRAIN_AXES)])
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return strategies, worlds, variants


def run(args: argparse.Namespace) -> int:
    try:
        strategies, worlds, variants = check_arguments(args)
        _weak_scaling_micro_batch(args)
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
            cells.setdefault((s, n, label), []).append(_run_cell(args, s, n, v, out, f"r{rep}"))
    rows = summarize(cells, args.warmup)
    table = to_markdown(rows)
    what = (f"config {args.config}" if args.config else f"GPT {args.preset}, seq {args.seq_len}, synthetic tokens")
    header = (f"shardlab bench, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n"
              f"command: shardlab bench {' '.join(sys.argv[2:] if sys.argv[1:2] == ['bench'] else sys.argv[1:])}\n"
              f"model: {what} ({rows[0]['num_parameters'] / 1e6:.2f}M params), micro batch {args.micro_batch or 8} "
              f"per rank x {args.micro_batches} micro batch(es) per step, {args.steps} steps x {args.repeats} round(s), {args.warmup} warmup steps per run excluded\n")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
