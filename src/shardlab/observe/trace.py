"""`shardlab trace RUN_DIR [--out FILE.json]`: the flight records of every rank and attempt as one
Chrome trace-event JSON (the format Perfetto and chrome://tracing open).

One process per rank. Per attempt, a track of its phases (complete events from one phase mark
to the next, with the step in their arguments) and tracks of its collectives (complete events
from issue to completion; overlapping ones, an engine's prefetch, on further tracks, since a
track's events must nest), the step as a counter, and an instant event where the attempt
ended (finished, failed, preempted, lost). Times are microseconds from the first record of
the run. Profiler traces the run wrote (train.profile: `<run dir>/profile/rank<r>.json`) are
listed in the trace's `otherData` and printed: they are separate files, as each has its own
clock.

The flight record keeps each rank's last doctor.record_size collectives and phase marks: a
long run's trace shows its last steps. `otherData.coverage` says per attempt and rank which steps
the trace holds whole and which the rank completed (its step summaries), and `otherData.note`
(printed by the command) says when those differ and why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from shardlab.doctor.flight_read import Flight
from shardlab.observe.runs import Attempt, NotARun, coverage, read_run

#: tracks per attempt within a rank's process: phases, then collective lanes
_TRACKS_PER_ATTEMPT = 100
#: thread ids per rank: a thread id is unique across the whole trace (rank x this + attempt's base +
#: track, from 1), because Perfetto's JSON importer takes thread ids as the system's, unique across
#: processes: with each rank's tracks numbered from 0 it merged rank 1's phases into another track
_TIDS_PER_RANK = 1_000_000


def build_trace(run_dir: str, now: float | None = None) -> dict[str, Any]:
    run = read_run(run_dir)
    now = time.time() if now is None else now
    t0 = min((a.started for a in run.attempts), default=0.0)
    events: list[dict[str, Any]] = []
    ranks = sorted({r for a in run.attempts for r in a.flights})
    for r in ranks:
        tid = r * _TIDS_PER_RANK + 1
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": tid, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": tid, "args": {"sort_index": r}})
    covered, notes = [], []
    for i, a in enumerate(run.attempts):
        for _, flight in sorted(a.flights.items()):
            events += _rank_events(i, a, flight, t0, now)
        c = coverage(a)
        covered += [{"launch": a.launch, "attempt": a.attempt, "rank": r, "steps_in_trace": c["held"][r],
                     "steps_completed": c["steps"].get(r)} for r in sorted(a.flights)]
        if c["note"]:
            notes.append(f"{a.label}: {c['note']}; the report's split per rank covers every step")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run_dir": os.path.abspath(run_dir), "origin_unix_s": t0,
                          "attempts": [{"launch": a.launch, "attempt": a.attempt, "world": a.world,
                                        "state": a.state(now)} for a in run.attempts],
                          "coverage": covered, "note": "; ".join(notes) or None,
                          "profiler_traces": run.profiles}}


def _us(t: float, t0: float) -> int:
    """Whole microseconds since t0: integers, so that a span ending where the next begins ends
    exactly there (a viewer takes 0.1 us of float rounding for spans that overlap)."""
    return round((t - t0) * 1e6)


def _rank_events(i: int, a: Attempt, flight: Flight, t0: float, now: float) -> list[dict[str, Any]]:
    pid = flight.rank
    base = pid * _TIDS_PER_RANK + i * _TRACKS_PER_ATTEMPT + 1   # this attempt's phases; its lanes follow
    attempt = f"attempt {a.attempt}, {a.launch}"   # after the track's kind: a viewer cuts long titles short
    out = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": base, "args": {"name": f"phases ({attempt})"}}]
    marks = sorted(flight.marks, key=lambda m: m.number)
    step = None
    for m, nxt in zip(marks, [*marks[1:], None]):
        end = nxt.time if nxt is not None else max(flight.updated, m.time)
        if end > m.time:
            out.append({"ph": "X", "name": m.phase, "cat": "phase", "pid": pid, "tid": base, "ts": _us(m.time, t0),
                        "dur": _us(end, t0) - _us(m.time, t0), "args": {"step": m.step}})
        if m.step != step:
            step = m.step
            out.append({"ph": "C", "name": "step", "pid": pid, "tid": base, "ts": _us(m.time, t0),
                        "args": {"step": m.step}})
    lanes: list[float] = []        # per lane, when its last span ends
    groups = a.metas.get(flight.rank, {}).get("groups", [])
    units = a.metas.get(flight.rank, {}).get("units", [])
    for e in sorted(flight.entries, key=lambda e: e.issued):
        end = e.completed if e.done else max(flight.updated, e.issued)
        lane = next((k for k, last in enumerate(lanes) if last <= e.issued), len(lanes))
        if lane == len(lanes):
            lanes.append(0.0)
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": base + 1 + lane,
                        "args": {"name": "collectives" + (f" {lane + 1}" if lane else "") + f" ({attempt})"}})
        lanes[lane] = end
        group = groups[e.group] if 0 <= e.group < len(groups) else {}
        args = {"seq": e.seq, "bytes": e.nbytes, "group": group.get("ranks"), "phase": e.phase, "step": e.step,
                "completed": e.done,
                "waited_from_us": _us(e.waited, t0) if e.waited > 0 else ("issue" if e.waited == 0 else None)}
        if 0 <= e.unit < len(units):
            args["unit"] = units[e.unit]
        out.append({"ph": "X", "name": f"{e.kind} #{e.seq}", "cat": "collective", "pid": pid, "tid": base + 1 + lane,
                    "ts": _us(e.issued, t0), "dur": _us(end, t0) - _us(e.issued, t0), "args": args})
    out.append({"ph": "i", "s": "t", "name": f"attempt {a.attempt}: {a.state(now)}", "pid": pid, "tid": base,
                "ts": _us(max(flight.updated, flight.tick), t0)})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", metavar="FILE.json", help="where to write it (default: RUN_DIR/trace.json)")


def run(args: argparse.Namespace) -> int:
    try:
        trace = build_trace(args.run_dir)
    except NotARun as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not trace["otherData"]["attempts"]:
        print(f"error: {args.run_dir} has no flight records (debug/rank*.flight): the run had doctor.enabled=false "
              "or has not started", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run_dir, "trace.json")
    with open(out, "w") as f:
        json.dump(trace, f)
    n = len(trace["otherData"]["attempts"])
    print(f"trace: {out} ({len(trace['traceEvents'])} events, {n} attempt(s)); open it in https://ui.perfetto.dev "
          "or chrome://tracing, or offline with `vizviewer FILE` (`make setup` installs it)")
    if trace["otherData"]["note"]:
        print(f"trace: {trace['otherData']['note']}")
    for path in trace["otherData"]["profiler_traces"]:
        print(f"profiler trace beside it: {path}")
    return 0
