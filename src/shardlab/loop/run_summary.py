"""What a training run reports at its end: `summarize` (metrics.json, from every rank's
measurements: measurements.py) and `print_summary` (the table rank 0 prints). `run` is run.Run.

[Note: records stay true]
A run may be trained by several attempts: restarts, preemptions, an elastic group re-formed at
another world size, the same command run again. metrics.json's keys describe the attempt that
trained the last steps, as they do for a run of one attempt (`world_size`, `steps_this_run`,
`step_times_s`, throughput), and `attempts` lists every attempt that trained or resumed, oldest
first: its launch and restart count, world size, the steps it went from and to, when it started,
its wall and training seconds (`attempts_of`, from steps.jsonl's start and end events and step
records; the attempt writing the file as it measured itself). A group that starts when the run
had already reached its last step, and metrics.json records that step, trains nothing and
rewrites nothing (run.py, `finished_record`): it says so in one line and exits 0.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from shardlab.atomic import write_json_atomic
from shardlab.data.mixture import MixtureSampler, source_counts
from shardlab.engines import is_sharded
from shardlab.loop import metrics as M
from shardlab.loop.runtime import all_gather_object
from shardlab.observe.runs import STEPS_FILE


def step_tokens(run: Any, step_index: int) -> int | None:
    """Tokens of the global batch of step `step_index` (0-based): its samples' real tokens where
    the data says (padding excluded), else samples x tokens per sample; None for other data."""
    if run.data.real_tokens is not None:
        return int(run.data.real_tokens[run.sampler.rank_indices(step_index, 0, 1)].sum())
    if run.data.tokens_per_sample:
        return run.cfg.train.global_batch_size * run.data.tokens_per_sample
    return None


def summarize(run: Any, timer: M.StepTimer, mine: dict, val_losses: dict, wall: float,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """metrics.json, written by rank 0 and returned on every rank: `mine` (this rank's peak
    memory, model state, traffic, live-memory breakdown, compile time) gathered from every rank.
    Throughput counts only the steps this process trained (a resumed run's earlier steps are in
    `losses` but not in its timings), and under train.compile only those after the first
    (`throughput`). val_losses: step -> evaluate.Evaluation. `extra`: rank 0's further keys
    (MFU: measurements.py)."""
    cfg, rt, state = run.cfg, run.rt, run.state
    steps_run = len(timer.times)
    train_seconds = sum(timer.times)
    this = {"launch": os.environ.get("TORCHELASTIC_RUN_ID"), "attempt": rt.restart_count, "world_size": rt.world_size,
            "steps_from": state.step - steps_run, "steps_to": state.step, "started": time.time() - wall,
            "wall_s": wall, "train_s": train_seconds}
    # rank 0 reads the earlier attempts ([Note: records stay true]); the gather brings them to every rank
    per_rank = all_gather_object({**mine, "attempts": attempts_of(run.out_dir, this) if rt.is_main else None}, rt)
    waits = [run.batches.wait_s.get(s, 0.0) for s in range(state.step - steps_run, state.step)] if run.batches else []
    result: dict[str, Any] = {
        "wall_clock_s": wall,
        "train_time_s": train_seconds,
        "steps": state.step,
        "steps_this_run": steps_run,
        **throughput(run, timer.times),
        "step_time_median_s": timer.median() if steps_run else None,
        "step_times_s": timer.times,
        "world_size": rt.world_size,
        "strategy": cfg.parallel.strategy,
        "sharded": is_sharded(cfg.parallel.strategy),
        "device": M.device_name(rt.device),
        "num_parameters": run.num_parameters,
        "num_trainable_parameters": run.num_trainable,
        **_gathered(per_rank),
        # seconds each step of this run waited for its micro batches (data/loader.py), and their share
        "data_wait_s_per_step": waits,
        "data_wait_fraction": sum(waits) / train_seconds if train_seconds else None,
        "final_loss": state.losses[-1] if state.losses else None,
        "losses": state.losses,
        "val_loss": val_losses[state.step].loss,
        "val_losses": {step: v.loss for step, v in val_losses.items()},
        # a mixture's corpora (data.mix): each one's validation loss at the end, and at each evaluation
        **{f"val_loss/{name}": loss for name, loss in val_losses[state.step].by_source.items()},
        "val_losses_by_source": {step: v.by_source for step, v in val_losses.items() if v.by_source} or None,
        "restart_count": rt.restart_count,
        "attempts": per_rank[0]["attempts"],  # every attempt of the run, oldest first ([Note: records stay true])
        # train.compile: seconds compiling (slowest rank): the first step's (not in throughput nor the median step)
        # and the final evaluation's
        "compile_s": max(r["compile"][0] for r in per_rank) if cfg.train.compile else None,
        "compiled_graphs": per_rank[0]["compile"][1] if cfg.train.compile else None,
    }
    result.update(_optional(run, steps_run, wall))
    result.update(extra or {})
    if rt.is_main:
        write_json_atomic(os.path.join(run.out_dir, "metrics.json"), result, default=str)
    return result


def throughput(run: Any, times: list[float]) -> dict[str, Any]:
    """Samples and tokens processed in this run, and per second over the steps that measure speed:
    every step, or under train.compile the steps after the first, which compiles the blocks'
    forward and backward (docs/compile.md): averaging compilation in would show a fraction of
    the speed the median step shows. `throughput_steps`: how many steps the rates are over."""
    first = run.state.step - len(times)
    skip = 1 if run.cfg.train.compile else 0
    timed = times[skip:]
    seconds = sum(timed)
    out: dict[str, Any] = {"samples_processed": len(times) * run.cfg.train.global_batch_size,
                           "samples_per_s": len(timed) * run.cfg.train.global_batch_size / seconds if seconds else None,
                           "throughput_steps": len(timed)}
    if run.data.real_tokens is not None or run.data.tokens_per_sample:  # padding excluded where the data says
        tokens = [step_tokens(run, s) for s in range(first, run.state.step)]
        out["tokens_processed"] = sum(tokens)
        out["tokens_per_s"] = sum(tokens[skip:]) / seconds if seconds else None
    return out


def _gathered(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json's figures with one value per rank: memory, model state, traffic."""
    live = per_rank[0]["live"] is not None
    return {
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in per_rank],
        # live tensor bytes at each rank's peak and what they were then (shardlab.memory); null: not tracked
        "peak_live_bytes": [r["live"]["peak_live_bytes"] for r in per_rank] if live else None,
        "peak_breakdown": [{k: v for k, v in r["live"].items() if k != "peak_live_bytes"} for r in per_rank]
        if live else None,
        "model_state_bytes": [sum(r["model_state_bytes"].values()) for r in per_rank],
        "model_state_breakdown": [r["model_state_bytes"] for r in per_rank],
        "comm_bytes": [r["comm"] for r in per_rank],  # per collective kind, training steps only; null: not counted
        # per rank: collective kind -> seconds in each step of this run (as step_times_s), as the
        # caller saw them (engines/collectives.py; docs/benchmarks.md); null: not timed
        "comm_seconds_per_step": [r["comm_seconds"] for r in per_rank],
        # per rank: the worker process's CPU seconds in each step (every thread, user and system: compute,
        # the collectives' threads, the kernel's copies), aligned with step_times_s; on a CPU the wall time
        # beyond it is what the rank waited (plan/cpu.py reads it)
        "cpu_seconds_per_step": [r["cpu_seconds"] for r in per_rank],
    }


def _optional(run: Any, steps_run: int, wall: float) -> dict[str, Any]:
    """The keys only some runs have: checkpoint costs, the fp16 loss scale, a mixture's corpora."""
    out: dict[str, Any] = {}
    if run.cost is not None:  # every checkpoint's cost, rank 0's record (loop/run.py's `CheckpointCost`)
        out.update(run.cost.summary(wall))
    if run.scaler is not None:
        out["loss_scale"] = run.scaler.get_scale()
        out["skipped_steps"] = run.state.skipped_steps
    if isinstance(run.sampler, MixtureSampler):  # data.mix: samples and tokens per corpus, exact
        out["data_sources"] = source_counts(run.sampler, run.state.step - steps_run, run.state.step,
                                            run.data.tokens_per_sample)
    return out


def attempts_of(out_dir: str, this: dict[str, Any]) -> list[dict[str, Any]]:
    """Every attempt of the run in out_dir, oldest first, from steps.jsonl ([Note: records stay
    true]): `this`, the attempt summarizing, in place of its own start event's reading."""
    found: list[dict[str, Any]] = []
    try:
        with open(os.path.join(out_dir, STEPS_FILE)) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:  # a line cut short (a killed attempt)
                    continue
                _attempt_record(found, r)
    except OSError:
        pass
    if found and (found[-1]["launch"], found[-1]["attempt"]) == (this["launch"], this["attempt"]):
        found.pop()
    return [*found, this]


def _attempt_record(found: list[dict[str, Any]], r: dict[str, Any]) -> None:
    """One line of steps.jsonl into the attempts: a start event opens one, what follows extends it."""
    if r.get("event") == "start":
        found.append({"launch": r.get("launch"), "attempt": r.get("attempt"), "world_size": r.get("world"),
                      "steps_from": r.get("step"), "steps_to": r.get("step"), "started": r.get("time"),
                      "wall_s": 0.0, "train_s": 0.0})
        return
    if not found or not isinstance(r.get("step"), int):
        return
    a = found[-1]
    if r.get("event") == "end" or "loss" in r:
        a["steps_to"] = r["step"] if r.get("event") == "end" else max(a["steps_to"] or 0, r["step"])
    a["train_s"] += r.get("step_time_s") or 0.0
    if isinstance(r.get("time"), (int, float)) and isinstance(a["started"], (int, float)):
        a["wall_s"] = r["time"] - a["started"]


def print_summary(result: dict[str, Any], out_dir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"shardlab: {result['strategy']} on {result['world_size']} worker(s), {result['device']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    row = table.add_row
    row("steps", str(result["steps"]))
    if result["final_loss"] is not None:
        row("final loss", f"{result['final_loss']:.4f}")
    if result.get("val_loss") is not None:
        row("validation loss", f"{result['val_loss']:.4f}")
    for key in (k for k in result if k.startswith("val_loss/")):
        row(f"validation loss, {key[len('val_loss/'):]}", f"{result[key]:.4f}")
    if result["steps_this_run"]:
        _speed_rows(row, result)
    else:
        row("trained in this run", f"nothing: resumed at step {result['steps']}, the last")
    for source in result.get("data_sources") or []:
        row(f"tokens from {source['data_dir']}", f"{source['tokens']:,} ({source['share']:.1%}; weight "
            f"{source['weight']:.1%})")
    if "loss_scale" in result:
        row("fp16 loss scale (final), skipped steps", f"{result['loss_scale']:g}, {result['skipped_steps']}")
    row("parameters (trainable)", f"{result['num_parameters'] / 1e6:.2f} M "
        f"({result['num_trainable_parameters'] / 1e6:.2f} M)")
    row("model state / rank (params+grads+optim)", ", ".join(f"{b / 2**20:.1f} MiB" for b in result["model_state_bytes"]))
    row("peak memory / rank", ", ".join(f"{b / 2**30:.2f} GiB" for b in result["peak_memory_bytes"]))
    if result.get("peak_live_bytes"):
        row("peak live tensors / rank (phase)", ", ".join(
            f"{b / 2**20:.1f} MiB ({d['phase']})" for b, d in zip(result["peak_live_bytes"], result["peak_breakdown"])))
    elif result.get("compile_s") is not None:  # the tracker would stop dynamo compiling (measurements.py)
        row("peak live tensors / rank", "not tracked under train.compile")
    if result.get("checkpoint_saves"):
        row("checkpoints: held up / written", f"{len(result['checkpoint_saves'])} saves: "
            f"{result['checkpoint_blocking_total_s']:.2f} s ({result['checkpoint_blocking_fraction']:.1%} of the "
            f"wall clock) / {result['checkpoint_write_total_s']:.2f} s")
    row("wall clock", f"{result['wall_clock_s']:.1f} s")
    Console().print(table)
    print(f"run directory: {out_dir}")


def _speed_rows(row: Any, result: dict[str, Any]) -> None:
    """Throughput, the median step, MFU (or why it is not measured) and compile time: under
    train.compile the rates leave out the run's first step, which compiled, and say so; the
    compile row gives that step's time beside the compile seconds. Values short enough for the
    80 columns a table gets in a log."""
    compiled = result.get("compile_s") is not None
    first = result["steps"] - result["steps_this_run"] + 1  # the run's first step, counted from 1
    after = f" (steps {first + 1}-{result['steps']})" if compiled and result["throughput_steps"] else ""
    if result["samples_per_s"] is None:
        row("samples/s", "not measured: the only step compiled" if compiled else "not measured")
    else:
        row("samples/s", f"{result['samples_per_s']:.1f}{after}")
        if result.get("tokens_per_s"):
            row("tokens/s", f"{result['tokens_per_s']:.0f}{after}")
    if result["step_time_median_s"] is not None:
        row("median step time", f"{result['step_time_median_s'] * 1000:.1f} ms")
    if result.get("mfu") is not None:
        row("MFU (median step)", f"{result['mfu']:.2%} of {result['peak_flops_per_s'] / 1e9:.1f} GFLOP/s per rank")
    elif compiled:  # metrics.json's mfu_note says why
        row("MFU", "not counted under train.compile")
    elif result.get("mfu_note"):
        row("MFU", result["mfu_note"])
    if compiled:  # most of it in the first step; the final evaluation recompiles outside the steps
        graphs = result["compiled_graphs"]
        row("torch.compile", f"{result['compile_s']:.1f} s, {graphs} graph{'' if graphs == 1 else 's'}; "
            f"step {first}: {result['step_times_s'][0]:.1f} s")
