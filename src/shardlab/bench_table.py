"""`shardlab bench`'s results: one row per cell (`summarize`, over its rounds), the markdown table
and its notes (`to_markdown`), the compiled cells beside their eager twins, the plot; the
theory columns (`comm_bus_theory`). The cells themselves: bench_cells.py.

[Note: the time a step waited on collectives]
Two figures of communication time, and only one of them is part of the step. "comm waited" is
the time a rank's step stood still waiting for collectives: the union of its waits (from the
`wait()` of an async call, or the issue of a blocking one, until it returned), from the flight
record's step split ([Note: where a step's time goes] in observe/runs.py; the step there runs
from its mark to the next step's). It counts every collective the step waited on: the engine's
and the loop's own (the token count, the gradient norm, the step boundary's agreement). It is at
most the step, and what the step would save if communication were free and ranks balanced.
"in flight, by kind" is each of the engine's kinds, its calls timed from issue until their wait
returned, summed: calls in flight together each count in full and the compute overlapped before
the wait is in it, so it can exceed the step (zero3's reduces, all waited at the end of
backward). It says how long collectives were outstanding, not what they cost. torch-ddp's
buckets complete in a callback DDP waits for in C++: the record never sees that wait, which
counts as compute, so its waited figure says so.
"""

from __future__ import annotations

import statistics
from typing import Any

from shardlab.bench_cells import takes_axis
from shardlab.engines import STRATEGIES, engine_class

BYTES_FP32 = 4

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
        steps = [t for m in runs for t in m["step_times_s"][warmup:]]
        round_medians = [statistics.median(m["step_times_s"][warmup:]) for m in runs]
        m = runs[0]
        psi, sharded = m["num_parameters"], m["sharded"]
        shard_size = m.get("shard_size") or (nproc if sharded else 1)
        median = statistics.median(steps)
        compiled = [r["compile_s"] for r in runs if r.get("compile_s") is not None]
        rows.append({
            "strategy": strategy, "world_size": nproc, "variant": key[2] if len(key) > 2 else "", "num_parameters": psi,
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
            **_comm_columns(runs, warmup),
            **_memory_columns(runs),
            "final_loss": m["final_loss"], "device": m.get("device"),
            # torch.compile seconds of the run (train.compile), median over rounds
            "compile_s": statistics.median(compiled) if compiled else None,
        })
    return rows


def _comm_columns(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The row's collective figures ([Note: the time a step waited on collectives]): per kind,
    calls and bus bytes (mean over ranks) and the seconds in flight (per rank the median over the
    measured steps, and the largest rank's); the seconds each step waited, likewise."""
    comm = _comm_by_kind(runs, warmup)
    return {"comm_calls_per_step": comm["calls"], "comm_bus_bytes_per_step_by_kind": comm["bus_bytes"],
            "comm_seconds_per_step": comm["seconds_per_rank"],
            "comm_seconds_per_step_max_rank": comm["seconds_max_rank"], **_waited(runs, warmup)}


def _waited(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per rank, the median over the measured steps of every round of the seconds the step waited
    on collectives (bench_cells.waited_comm; steps counted from 1, as the flight record counts
    them), the largest rank's, and the kinds whose waits the record cannot see. None: a run kept
    no flight records."""
    records = [m.get("comm_waited") for m in runs]
    if any(r is None for r in records):
        return {"comm_waited_s_per_step": None, "comm_waited_s_per_step_max_rank": None, "comm_unwaited_kinds": None}
    per_rank = []
    for rank in range(len(records[0]["per_rank"])):
        measured = [w for r in records for step, w, _ in r["per_rank"][rank] if step > warmup]
        per_rank.append(statistics.median(measured) if measured else None)
    known = [w for w in per_rank if w is not None]
    return {"comm_waited_s_per_step": per_rank, "comm_waited_s_per_step_max_rank": max(known) if known else None,
            "comm_unwaited_kinds": sorted({k for r in records for k in r["unwaited"]})}


def _memory_columns(runs: list[dict[str, Any]]) -> dict[str, Any]:
    m = runs[0]
    live = [max(r["peak_live_bytes"]) for r in runs if r.get("peak_live_bytes")]
    return {"peak_rss_bytes_max_rank": max(m["peak_memory_bytes"]),
            # live tensor bytes at the step's peak (the memory tracker), median over rounds
            "peak_live_bytes_max_rank": statistics.median(live) if live else None,
            "peak_breakdown": (m.get("peak_breakdown") or [None])[0]}


def speed_vs(twin: dict[str, Any], r: dict[str, Any]) -> str:
    """The speed ratio with the rounds' spread beside it; a ratio whose distance from 1 is
    smaller than the spread of either cell is not resolved, and says so."""
    ratio = twin["step_time_median_s"] / r["step_time_median_s"]
    if len(r["round_medians_s"]) < 2:
        return f"{ratio:.2f}x (1 round: spread unknown)"
    spread = max(r["round_spread"], twin["round_spread"])
    verdict = " within noise" if spread > abs(ratio - 1) else ""
    return f"{ratio:.2f}x (rounds ±{spread * 50:.0f}%{verdict})"


HEAD = ("| strategy | N | variant | median step (ms) | p90 (ms) | samples/s | speed vs torch twin "
        "| model state / rank (MiB) | theory (MiB) | vs ddp | peak live / rank (MiB) | vs ddp "
        "| peak RSS / rank (GiB) | sent / rank / step (MiB) | theory (MiB) | comm waited ms / step (max rank) "
        "| collectives in flight ms / step, by kind (max rank; overlapped, not step time) |")


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """The table, one line per row, its notes, and the compiled cells' table when there are any."""
    by = {(r["strategy"], r["world_size"], r["variant"]): r for r in rows}
    lines = [HEAD, "|" + "---|" * HEAD.count(" |")]
    lines += [_line(r, by) for r in rows]
    return "\n".join(lines) + "\n" + "\n".join(_notes(rows)) + "\n" + _compile_table(rows, by)


def _other_cell(by: dict[tuple, dict[str, Any]], strategy: str, n: int, variant: str) -> dict[str, Any] | None:
    """Another engine's cell with the same settings, as far as it takes them."""
    if strategy not in STRATEGIES:
        return None
    accepted = engine_class(strategy).options
    own = ",".join(kv for kv in variant.split(",") if kv and takes_axis(accepted, kv.split("=")[0]))
    return by.get((strategy, n, own))


def _line(r: dict[str, Any], by: dict[tuple, dict[str, Any]]) -> str:
    """A row's line: "speed vs torch twin" against its torch twin's cell, "vs ddp" against the first
    replicated engine with a cell at the same settings."""
    mib, n, v = 2**20, r["world_size"], r["variant"]
    twin = STRATEGIES[r["strategy"]].torch_twin if r["strategy"] in STRATEGIES else None
    t = _other_cell(by, twin, n, v) if twin else None
    replicated = [s for s in STRATEGIES if engine_class(s).distributed and not engine_class(s).grads_sharded]
    d = next((c for c in (_other_cell(by, s, n, v) for s in replicated) if c is not None), None)
    mem = f"{r['model_state_bytes_max_rank'] / d['model_state_bytes_max_rank']:.2f}x" if d else ""
    live = "" if r["peak_live_bytes_max_rank"] is None else f"{r['peak_live_bytes_max_rank'] / mib:.1f}"
    live_vs = (f"{r['peak_live_bytes_max_rank'] / d['peak_live_bytes_max_rank']:.2f}x"
               if live and d and d["peak_live_bytes_max_rank"] else "")
    sent = "not counted" if r["comm_bus_bytes_per_step"] is None else f"{r['comm_bus_bytes_per_step'] / mib:.1f}"
    state_theory = f"{r['model_state_theory_bytes'] / mib:.1f}" + (" on host" if _offloaded(r) else "")
    return (f"| {r['strategy']} | {n} | {v or 'default'} | {r['step_time_median_s'] * 1000:.0f} | "
            f"{r['step_time_p90_s'] * 1000:.0f} | {r['samples_per_s']:.2f} | {speed_vs(t, r) if t else ''} | "
            f"{r['model_state_bytes_max_rank'] / mib:.1f} | {state_theory} | {mem} | "
            f"{live} | {live_vs} | {r['peak_rss_bytes_max_rank'] / 2**30:.2f} | {sent} | "
            f"{r['comm_bus_theory_bytes_per_step'] / mib:.1f} | {_waited_ms(r)} | {_comm_ms(r)} |")


def _notes(rows: list[dict[str, Any]]) -> list[str]:
    notes = [
        "'sent' is what one rank sends per training step on a ring (nccl-tests' bus bytes), counted by "
        "shardlab.engines.collectives (PyTorch's engines: DDP's comm hook, FSDP2's custom collectives). Theory: "
        "16 bytes/param for DDP + AdamW (12 SGD with momentum, 8 without), /S sharded (S = shard group size: "
        "N, or parallel.shard_size with HSDP); 2(N-1)/N x 4 bytes/param (all-reduce) vs 3(S-1)/S x 4 + "
        "2(R-1)/R x 4/S bytes/param (sharded over S, all-reduced over R = N/S replicas). 'peak live' is the "
        "largest live-tensor total of a rank during a step (metrics.json peak_live_bytes).",
        "'comm waited': the milliseconds a rank's step stood still waiting for collectives (the union of its "
        "waits, from the hang doctor's flight record), median over measured steps, largest rank: part of the "
        "step, never more than it. It includes waiting for the slowest rank.",
        "'collectives in flight': per kind (ag all-gather, rs reduce-scatter, ar all-reduce, bc broadcast, rd "
        "reduce), each call timed from issue until its wait returned (torch-ddp's buckets: until the future "
        "completes), summed over the calls, median over measured steps, largest rank. Calls in flight together "
        "each count in full and the compute overlapped before a wait is inside, so it is not time the step "
        "spent and can exceed the step; on CUDA with NCCL it times issue only (docs/benchmarks.md).",
    ]
    if any(_offloaded(r) for r in rows):
        notes.append("offload=cpu: the model state (theory 'on host') lives in host memory; the device holds only "
                     "transients (the gathered units, gradients in flight, activations). "
                     + ("On this CPU-only machine the device is the CPU, so measured memory (model state, peak "
                        "live, RSS) does not drop with offload; the saving shows only on a GPU."
                        if not any("cuda" in str(r.get("device", "")).lower() for r in rows) else ""))
    return notes


def _compile_table(rows: list[dict[str, Any]], by: dict[tuple, dict[str, Any]]) -> str:
    """Compiled cells beside their eager twins (the same cell with compile=false)."""
    lines = []
    for r in rows:
        if r.get("compile_s") is None:
            continue
        eager = by.get((r["strategy"], r["world_size"], r["variant"].replace("compile=true", "compile=false")))
        vs = speed_vs(eager, r) if eager else ""
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


def _waited_ms(r: dict[str, Any]) -> str:
    """'12.3' from the row's waited seconds (largest rank); the kinds whose waits DDP makes in C++,
    out of the record's sight, named beside it."""
    waited = r.get("comm_waited_s_per_step_max_rank")
    if waited is None:
        return "not recorded (no flight record: doctor.enabled=false)" if r.get("comm_waited_s_per_step") is None else ""
    unseen = ", ".join(_KIND_ABBREV.get(k, k) for k in r.get("comm_unwaited_kinds") or [])
    return f"{waited * 1000:.1f}" + (f" (+ {unseen} waited inside DDP: not seen)" if unseen else "")


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
