"""`shardlab report RUN_DIR [--out FILE.html]`: one self-contained HTML file on where a run's time
and memory went (docs/observability.md): loss and validation curves, tokens/s and MFU per step,
per rank and step the time split into data wait, compute, exposed communication and checkpoint
(runs.py), the slowest rank and by how much, peak memory per rank by phase and part (when the
run tracked it), bytes and time per collective kind beside plan's theory, the attempts
(restarts, preemptions, world sizes) on the time axis, and the hang doctor's findings. Plots are
PNGs embedded in the file (matplotlib: the `plot` extra). It reads only files, so it works on a
finished run, a failed one and one still running.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import os
import sys
import time
from typing import Any

from shardlab.doctor import analysis
from shardlab.doctor import report as doctor_report
from shardlab.observe.runs import (
    PARTS,
    NotARun,
    Run,
    attempt_splits,
    collective_totals,
    coverage,
    mean_split,
    read_run,
    slowest_rank,
    step_splits,
)

_CSS = """body{font-family:sans-serif;max-width:1000px;margin:1em auto;color:#222}h1{font-size:1.4em}
h2{font-size:1.15em;border-bottom:1px solid #ccc;margin-top:1.6em}table{border-collapse:collapse;font-size:.85em}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}
figure{margin:.6em 0}figure img{max-width:100%}.note{color:#555;font-size:.85em}.bad{color:#b00}
pre{background:#f7f7f7;padding:.5em;font-size:.8em;white-space:pre-wrap}"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _table(head: list[str], rows: list[list[Any]]) -> str:
    h = "".join(f"<th>{_esc(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _figure(png: str | None, name: str, missing: str) -> str:
    if png is None:
        return f'<p class="note">{_esc(missing)}</p>'
    return f'<figure data-plot="{name}"><img alt="{name}" src="data:image/png;base64,{png}"></figure>'


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f}"


def build_report(run_dir: str, now: float | None = None) -> str:
    from shardlab.observe import plots  # deferred: matplotlib is an extra, checked by `run`

    run = read_run(run_dir)
    now = time.time() if now is None else now
    sections = [_header(run, now), _findings(run), _attempts(run, now, plots), _curves(run, plots),
                _throughput(run, plots), _time_split(run, plots), _memory(run, plots), _router(run),
                _collectives(run, plots), _profiles(run)]
    title = f"shardlab report: {_esc(os.path.basename(os.path.abspath(run_dir)))}"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title><style>{_CSS}</style></head>"
            f"<body><h1>{title}</h1>{''.join(sections)}</body></html>\n")


def _header(run: Run, now: float) -> str:
    m, cfg = run.metrics or {}, run.config or {}
    last = run.attempts[-1] if run.attempts else None
    state = "finished" if run.metrics else (last.state(now) if last else "no flight record")
    rows = [["run directory", os.path.abspath(run.path)], ["state", state],
            ["strategy", m.get("strategy") or (cfg.get("parallel") or {}).get("strategy") or (last and last.strategy)],
            ["world size", m.get("world_size") or (last.world if last else "-")],
            ["device", m.get("device", "-")], ["steps", m.get("steps") or (run.records[-1].get("step")
                                                                           if run.records else "-")],
            ["attempts", len(run.attempts)], ["as of", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))]]
    return "<h2>Run</h2>" + _table(["", ""], rows)


def _findings(run: Run) -> str:
    out = ["<h2>Findings of the hang doctor</h2>"]
    if not run.attempts:
        return out[0] + '<p class="note">no flight records (doctor.enabled=false, or the run has not started)</p>'
    d = analysis.diagnose(run.path)
    if d.kind in ("finished", "running", "no record"):
        out.append(f"<p>latest attempt: {_esc(d.kind)}; nothing wrong found.</p>")
    else:
        out.append(f'<p class="bad">{_esc(doctor_report.verdict(d))}</p>'
                   f"<pre>{_esc(doctor_report.format_report(d, with_verdict=False))}</pre>")
    for a in run.attempts[:-1]:
        for r, e in sorted(a.exits.items()):
            out.append(f"<p>{_esc(a.label)}: rank {r} ended by {_esc(e.get('exception'))}: "
                       f"{_esc(e.get('message', ''))[:300]} (step {e.get('step')}, phase {_esc(e.get('phase'))})</p>")
    return "".join(out)


def _attempts(run: Run, now: float, plots: Any) -> str:
    if not run.attempts:
        return ""
    t0 = run.attempts[0].started
    rows = [{"label": a.label, "start": a.started - t0, "end": a.ended - t0, "state": a.state(now), "world": a.world}
            for a in run.attempts]
    table = _table(["attempt", "start (s)", "end (s)", "ranks", "state", "steps recorded"],
                   [[a.label, f"{r['start']:.1f}", f"{r['end']:.1f}", a.world, r["state"],
                     _step_range(a)] for a, r in zip(run.attempts, rows)])
    return "<h2>Attempts</h2>" + _figure(plots.attempts(rows), "attempts", "") + table


def _step_range(a) -> str:
    steps = [m.step for f in a.flights.values() for m in f.marks if m.step > 0]
    steps += [s.step for ss in a.summaries.values() for s in ss]   # the marks' ring may hold the last ones only
    return f"{min(steps)}-{max(steps)}" if steps else "-"


def _curves(run: Run, plots: Any) -> str:
    train = [(r["step"], r["loss"], r.get("attempt", 0)) for r in run.records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in run.records if r.get("val_loss") is not None]
    if not train and run.metrics:  # a run from before steps.jsonl
        train = [(i + 1, v, 0) for i, v in enumerate(run.metrics.get("losses") or [])]
        val = [(int(s), v) for s, v in (run.metrics.get("val_losses") or {}).items() if v is not None]
    elif run.metrics and run.metrics.get("val_loss") is not None:
        val.append((run.metrics["steps"], run.metrics["val_loss"]))   # the final evaluation
    return "<h2>Loss</h2>" + _figure(plots.curves(train, sorted(set(val))), "loss", "no step recorded yet")


def _throughput(run: Run, plots: Any) -> str:
    rows = [(r["step"], r.get("tokens_per_s"), r.get("mfu")) for r in run.records if "step_time_s" in r]
    m = run.metrics or {}
    text = ""
    if m.get("mfu") is not None:
        text = (f"<p>MFU (median step, the first left out): <b>{m['mfu']:.2%}</b> = FLOPs per step and rank "
                f"{m['flops_per_step_per_rank']:.4g} / step time / peak {m['peak_flops_per_s']:.4g} FLOP/s "
                f"({_esc(m['peak_flops_source'])}); FLOPs per token {m.get('flops_per_token') or 0:.4g}.</p>")
    if m.get("mfu_note"):
        text += f'<p class="note">MFU: {_esc(m["mfu_note"])}</p>'
    return "<h2>Throughput and MFU</h2>" + text + _figure(plots.throughput(rows), "throughput", "no step recorded")


def _time_split(run: Run, plots: Any) -> str:
    out = ["<h2>Where each step's time went, per rank</h2>",
           '<p class="note">From the flight records: data wait (phase data), exposed communication (waiting '
           "for a collective), checkpoint and eval (those phases), compute (the rest).</p>"]
    for a in run.attempts:
        splits = attempt_splits(a)
        if not splits:
            out.append(f'<p class="note">{_esc(a.label)}: no complete step recorded</p>')
            continue
        out.append(f'<p class="note" data-covers="split">{_esc(a.label)}: {_esc(_split_coverage(a, splits))}</p>')
        means = {r: mean_split(s) for r, s in splits.items()}
        out.append(_figure(plots.time_split(means, f"{a.label}: ms per step by part"), f"split-{a.attempt}-{a.launch}",
                           ""))
        out.append(_table(["rank", "steps", *[f"{p} ms" for p in PARTS], "step ms"],
                          [[f"rank {r}", len(splits[r]), *[_ms(v[p]) for p in PARTS], _ms(sum(v.values()))]
                           for r, v in means.items()]))
        out.append(_slowest_text(slowest_rank(splits)))
        series = {r: [(s.step, s.busy * 1000) for s in ss] for r, ss in splits.items()}
        out.append(_figure(plots.busy_per_step(series), f"busy-{a.attempt}-{a.launch}", ""))
    return "".join(out)


def _split_coverage(a, splits) -> str:
    """Which steps the split covers: every completed step (the step summaries), else the rings'."""
    ranges = sorted({(s[0].step, s[-1].step, len(s)) for s in splits.values()})
    steps = "; ".join(f"steps {x}-{y} ({n} steps)" for x, y, n in ranges)
    if all(r in a.summaries for r in splits):
        return f"{steps}: every step each rank completed (its step summaries, debug/rank<r>.steps)"
    note = coverage(a)["note"]
    return f"{steps}, from the flight record" + (f" ({note}; this run wrote no step summaries)" if note else "")


def _slowest_text(s: dict[str, Any] | None) -> str:
    if s is None:
        return '<p class="note">slowest rank: fewer than two ranks with steps in common</p>'
    if s["rank"] is None:
        return (f"<p>slowest rank: none stands out (the busiest, rank {s['candidate']}, is "
                f"{_ms(s['excess_s'])} ms per step above the others' median, the busiest in {s['share']:.0%} of "
                f"{s['steps']} steps; named from 10 % of the step and 75 % of the steps).</p>")
    return (f'<p class="bad"><b>slowest rank: rank {s["rank"]}</b>, busy {_ms(s["busy_s"])} ms per step, '
            f"{_ms(s['excess_s'])} ms ({s['excess_s'] / s['step_s']:.0%} of the {_ms(s['step_s'])} ms step) more "
            f"than the other ranks' median; the busiest in {s['share']:.0%} of {s['steps']} steps. Its data wait: "
            f"{_ms(s['data_s'])} ms per step (the others: {_ms(s['others_data_s'])} ms).</p>")


def _memory(run: Run, plots: Any) -> str:
    m = run.metrics or {}
    rows = [[f"rank {r}", f"{b / 2**20:.1f}"] for r, b in enumerate(m.get("peak_memory_bytes") or [])]
    text = _table(["rank", "peak memory MiB (RSS on CPU, allocator on CUDA)"], rows) if rows else ""
    breakdown = m.get("peak_breakdown")
    missing = ("not recorded: train.memory_tracking=none, or the run has not finished (metrics.json is written "
               "at the end)")
    return "<h2>Memory</h2>" + text + _figure(plots.memory(breakdown) if breakdown else None, "memory", missing)


def _router(run: Run) -> str:
    """A mixture of experts' routing over the run: metrics.json's `router` section ([Note: router
    statistics] in models/hf_router.py); nothing for a model without routers."""
    r = (run.metrics or {}).get("router")
    if not r:
        return ""
    rows = []
    for layer, counts in zip(r["layers"], r.get("tokens_per_expert") or []):
        total = sum(counts) or 1
        shares = " ".join(f"{c / total:.0%}" for c in counts)
        rows.append([layer, sum(counts), shares, f"{max(counts) * len(counts) / total:.2f}",
                     sum(1 for c in counts if c == 0)])
    table = _table(["layer", "assignments", f"share per expert (0..{r['experts'] - 1})", "busiest / mean",
                    "idle experts"], rows) if rows else '<p class="note">no training forward counted</p>'
    balance = r.get("balance_loss_mean")
    note = (f"<p>mean balancing loss {balance:.4f} over {r['balance_micro_batches']} micro batches (the loss took "
            f"{r['aux_loss_coef']} times it)</p>" if balance is not None else
            "<p class='note'>no balancing loss in the loss (output_router_logits is off)</p>")
    return (f"<h2>Routing: {r['experts']} experts, top {r.get('top_k')}, tokens per expert over the steps this run "
            f"trained, every rank</h2>" + table + note)


def _collectives(run: Run, plots: Any) -> str:
    a = run.attempts[-1] if run.attempts else None
    flight = a.flights.get(0) if a else None
    if flight is None:
        return ""
    steps = {s.step for s in step_splits(flight)}
    totals = collective_totals(flight, steps)
    if not totals or not steps:
        return "<h2>Collectives</h2><p class='note'>no collective recorded in a complete step</p>"
    covers = _collectives_coverage(a, steps)
    theory, note = _theory(run, a.world)
    rows = []
    for kind, t in sorted(totals.items()):
        th = theory.get(kind, {})
        rows.append({"kind": kind, "calls": t["calls"] / len(steps), "bytes": t["bytes"] / len(steps),
                     "seconds": t["seconds"] / len(steps), "exposed_s": t["exposed_s"] / len(steps),
                     "theory_bytes": th.get("bytes"), "theory_calls": th.get("calls"), "theory_s": th.get("seconds")})
    table = _table(["kind", "calls", "theory calls", "KiB", "theory KiB", "ms (issue to completion)", "exposed ms",
                    "theory ms"],
                   [[r["kind"], f"{r['calls']:.1f}", r["theory_calls"] or "-", f"{r['bytes'] / 1024:.1f}",
                     f"{r['theory_bytes'] / 1024:.1f}" if r["theory_bytes"] is not None else "-",
                     _ms(r["seconds"]), _ms(r["exposed_s"]), _ms(r["theory_s"])] for r in rows])
    return (f"<h2>Collectives per step (rank 0, steps {min(steps)}-{max(steps)} of {_esc(a.label)})</h2>"
            + (f'<p class="note" data-covers="collectives">{_esc(covers)}</p>' if covers else "")
            + _figure(plots.collectives(rows), "collectives", "") + table + f'<p class="note">{_esc(note)}</p>')


def _collectives_coverage(a, steps: set[int]) -> str | None:
    """When the table holds fewer steps than rank 0 completed: which, why, and what every step's
    summary says of the same collectives (calls and bytes per step)."""
    every = a.summaries.get(0) or []
    if not every:  # a run from before the step summaries
        return coverage(a)["note"]
    if len(every) <= len(steps):
        return None
    calls = sum(s.calls for s in every) / len(every)
    kib = sum(s.nbytes for s in every) / len(every) / 1024
    return (f"collectives of steps {min(steps)}-{max(steps)} ({len(steps)} of the {len(every)} steps rank 0 "
            f"completed): the flight record keeps the last {a.flights[0].capacity:,} collectives and phase marks "
            f"per rank (doctor.record_size). Over all {len(every)} steps (steps {every[0].step}-{every[-1].step}, "
            f"the step summaries): {calls:.1f} calls and {kib:.1f} KiB per step.")


def _theory(run: Run, world: int) -> tuple[dict[str, dict[str, float]], str]:
    """Per kind: bytes, calls and seconds per step as the engine's `step_traffic` says (plan's
    alpha-beta model over the link plan assumes: loopback on CPU)."""
    if not run.config:
        return {}, "theory: no run_args.json"
    try:  # deferred: plan imports torch and the engines
        from shardlab.config import config_from_dict
        from shardlab.plan.catalogue import INTERCONNECTS
        from shardlab.plan.traffic import collective_time, comm_plan

        cfg = config_from_dict(run.config)
        link = INTERCONNECTS["loopback"]
        out: dict[str, dict[str, float]] = {}
        for kind, nbytes, calls, ranks in comm_plan(cfg, cfg.parallel.strategy, world):
            t = out.setdefault(kind, {"bytes": 0.0, "calls": 0, "seconds": 0.0})
            t["bytes"] += nbytes * calls
            t["calls"] += calls
            t["seconds"] += calls * collective_time(kind, nbytes, ranks, link)
    except Exception as e:  # noqa: BLE001 - the measured side is reported whatever the theory can say
        return {}, f"theory unavailable: {type(e).__name__}: {e}"
    return out, ("theory: the engine's own collectives per step (Engine.step_traffic, as `shardlab bench` and plan "
                 "use), times by plan's alpha-beta model on the 'loopback' link (fitted on a 2-core VM); the loop's "
                 "own all-reduces (token count, loss) are measured but have no theory row.")


def _profiles(run: Run) -> str:
    if not run.profiles:
        return ""
    items = "".join(f"<li>{_esc(p)}</li>" for p in run.profiles)
    return f"<h2>Profiler traces</h2><ul>{items}</ul><p class='note'>open them in Perfetto</p>"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", metavar="FILE.html", help="where to write it (default: RUN_DIR/report.html)")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("matplotlib") is None:
        print("error: shardlab report draws with matplotlib: pip install 'shardlab[plot]'", file=sys.stderr)
        return 2
    try:
        text = build_report(args.run_dir)
    except NotARun as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run_dir, "report.html")
    with open(out, "w") as f:
        f.write(text)
    print(f"report: {out}")
    return 0
