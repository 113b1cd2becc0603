"""A run directory read back: its records per step (steps.jsonl, metrics.json), its attempts
(one per launch or restart: the flight records under `debug/` and `debug/previous/`), and per
rank and step where the time went. Files only, no torch: a finished run, a failed one, one still
running, or a copy of a cluster's run directory read the same.

[Note: where a step's time goes]
The flight record (doctor/flight.py) keeps every phase change and every new step (marks) and,
for every collective, when it was issued, when this rank began to wait for it and when its wait
returned. A step's wall time, from its mark to the next step's, splits into:
- data wait: phase "data" (the DataLoader's batches, doctor's phase marks);
- checkpoint, eval and log: those phases (with their collectives: DCP's, evaluation's sums; log is
  what the step's measurements cost: steps.jsonl, the trackers and the progress bar, on rank 0);
- exposed communication: the union of the intervals in which the rank waited for a collective
  of the step's other phases, from the wait's start (its issue, for a blocking call) to its
  completion. An asynchronous collective overlapped with compute counts only from its `wait()`;
  one completed by a callback the rank never waited on (PyTorch DDP's buckets) counts nothing;
- compute: the rest (forward, backward, optimizer and the loop's own work, outside those waits).
The slowest rank is the one the others wait for: its busy time (data wait and compute: the step
less its exposed communication, checkpoint and eval) is the largest (rank 0's logging is shown apart, as "log", and the others' wait for it as
their exposed communication). It is named only when it is the busiest rank in at least
SLOWEST_SHARE of the steps and its median busy time exceeds the other ranks' by at least
SLOWEST_MARGIN of the median step: a margin of the step, not of the noise seen on one machine,
so that ranks doing the same work are never told apart by scheduling jitter.
The flight record's rings keep the last doctor.record_size collectives and marks of a rank: the
last few hundred steps of a small model. Each rank also appends every step's split, computed
the same way (`split_step` in doctor/flight.py), to debug/rank<r>.steps as the step ends ([Note:
the step summaries] in doctor/flight.py): `attempt_splits` reads those, so the split and the
slowest rank cover every step; only the individual collectives and phases (the trace, the
report's collectives table) are the rings' last steps, which `Flight.whole_steps` names.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from shardlab.atomic import read_json
from shardlab.doctor.analysis import NOT_RUNNING_AFTER_S
from shardlab.doctor.flight import APART, PARTS, split_step, steps_path
from shardlab.doctor.flight_read import Flight, read_flight, read_step_summaries

#: rank 0's per-step records, one JSON object a line (loop/measurements.py's `StepLogger` writes it)
STEPS_FILE = "steps.jsonl"

SLOWEST_SHARE = 0.75
SLOWEST_MARGIN = 0.10


class NotARun(ValueError):
    pass


@dataclass
class Attempt:
    """One launch (or restart) of the run: every rank's flight record and meta."""

    launch: str
    attempt: int
    world: int
    flights: dict[int, Flight] = field(default_factory=dict)
    metas: dict[int, dict[str, Any]] = field(default_factory=dict)
    exits: dict[int, dict[str, Any]] = field(default_factory=dict)
    summaries: dict[int, list[Split]] = field(default_factory=dict)   # every completed step (rank<r>.steps)

    @property
    def label(self) -> str:
        return f"{self.launch} attempt {self.attempt}"

    @property
    def started(self) -> float:
        return min(f.started for f in self.flights.values())

    @property
    def ended(self) -> float:
        return max(max(f.updated, f.tick) for f in self.flights.values())

    @property
    def strategy(self) -> str | None:
        return next((m.get("strategy") for m in self.metas.values() if m.get("strategy")), None)

    def state(self, now: float) -> str:
        """finished | preempted | failed | running | lost (a rank stopped without a record: killed)."""
        states = {f.state for f in self.flights.values()}
        for s in ("failed", "preempted"):
            if s in states:
                return s
        if states == {"finished"}:
            return "finished"
        stale = [f for f in self.flights.values() if f.state == "running" and now - f.tick > NOT_RUNNING_AFTER_S]
        return "lost" if stale else "running"


@dataclass
class Split:
    """One rank's step: seconds of its wall time by part (PARTS)."""

    rank: int
    step: int
    start: float
    total: float
    parts: dict[str, float]
    calls: int = 0       # the step's training collectives (not those of APART's phases)
    nbytes: int = 0

    @property
    def busy(self) -> float:
        """The rank's own work in the step: data wait and compute (not its waits for the others, nor
        checkpoint and eval, which every rank does together, nor rank 0's logging)."""
        return self.parts["data"] + self.parts["compute"]


@dataclass
class Run:
    path: str
    metrics: dict[str, Any] | None
    config: dict[str, Any] | None
    records: list[dict[str, Any]]          # steps.jsonl, oldest first
    attempts: list[Attempt]                # oldest first
    profiles: list[str]                    # torch profiler traces under profile/


def read_run(path: str) -> Run:
    """The run at `path`; NotARun (one line) when nothing there is a shardlab run's."""
    debug = os.path.join(path, "debug")
    marks = [os.path.join(path, n) for n in ("run_args.json", "metrics.json", STEPS_FILE, "config.yaml")]
    if not os.path.isdir(path) or not (any(map(os.path.exists, marks)) or glob.glob(os.path.join(debug, "rank*"))):
        raise NotARun(f"{path} is not a shardlab run directory (none of run_args.json, metrics.json, {STEPS_FILE}, "
                      "config.yaml or debug/rank*.flight is there)")
    args = read_json(os.path.join(path, "run_args.json")) or {}
    return Run(path, read_json(os.path.join(path, "metrics.json")), args.get("config"), _read_records(path),
               read_attempts(debug), sorted(glob.glob(os.path.join(path, "profile", "*.json"))))


def finished_since(path: str, since: float) -> bool:
    """Whether the run at `path` trained all its steps (the config's `train.steps`) in a process that
    ended after `since` (unix seconds): rank 0 writes metrics.json when training ends. An elastic
    Slurm job asks, because srun reports its worst task: a lost agent's code even when the agents
    that remained finished the run (deploy/slurm.py)."""
    metrics = os.path.join(path, "metrics.json")
    try:
        if os.path.getmtime(metrics) < since:
            return False
    except OSError:
        return False
    steps = ((read_json(os.path.join(path, "run_args.json")) or {}).get("config") or {}).get("train", {}).get("steps")
    return steps is not None and (read_json(metrics) or {}).get("steps") == steps


def _read_records(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(os.path.join(path, STEPS_FILE)) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line being written
                    continue
    except OSError:
        pass
    return out


def read_attempts(debug: str) -> list[Attempt]:
    """Every attempt that left flight records: debug/ (the newest) and debug/previous/*/."""
    found: dict[tuple[str, int], Attempt] = {}
    for folder in [debug, *sorted(glob.glob(os.path.join(debug, "previous", "*")))]:
        for meta_path in glob.glob(os.path.join(folder, "rank*.meta.json")):
            meta = read_json(meta_path)
            if not isinstance(meta, dict) or not isinstance(meta.get("rank"), int):
                continue
            r = meta["rank"]
            try:
                flight = read_flight(os.path.join(folder, f"rank{r}.flight"))
            except (OSError, ValueError):
                continue
            key = (str(meta.get("launch")), int(meta.get("attempt", 0)))
            a = found.setdefault(key, Attempt(key[0], key[1], int(meta.get("world", 1))))
            a.flights[r], a.metas[r] = flight, meta
            summaries = read_step_summaries(steps_path(os.path.join(folder, f"rank{r}.flight")))
            if summaries:
                a.summaries[r] = [Split(r, x.step, x.start, x.total, x.parts, x.calls, x.nbytes) for x in summaries]
            exit_record = read_json(os.path.join(folder, f"rank{r}.exit.json"))
            if exit_record:
                a.exits[r] = exit_record
    return sorted(found.values(), key=lambda a: a.started)


# -- where each step's time went --------------------------------------------------------------------
def step_splits(flight: Flight) -> list[Split]:
    """The rank's complete steps that its rings still hold whole, each split by part ([Note: where a
    step's time goes]); `attempt_splits` has every step."""
    marks = sorted(flight.marks, key=lambda m: m.number)
    spans: dict[int, list[tuple[float, float, str]]] = {}
    for m, nxt in zip(marks, marks[1:]):
        if m.step > 0 and m.phase not in ("startup", "finish") and nxt.time >= m.time:
            spans.setdefault(m.step, []).append((m.time, nxt.time, m.phase))
    done = {m.step - 1 for m in marks if m.step > 1} | {m.step for m in marks if m.phase == "finish"}
    whole = flight.whole_steps()   # earlier steps lost collectives or marks to the rings
    waits: dict[int, list[tuple[float, float]]] = {}
    calls: dict[int, list[int]] = {}
    for e in flight.entries:
        if not e.done or e.phase in APART or e.phase in ("startup", "finish"):
            continue
        calls.setdefault(e.step, []).append(e.nbytes)
        if e.waited >= 0:
            waits.setdefault(e.step, []).append((e.waited if e.waited > 0 else e.issued, e.completed))
    out = []
    for step in sorted(s for s in spans if s in done and whole and s >= whole[0]):
        start, end = spans[step][0][0], spans[step][-1][1]
        parts = split_step(spans[step], waits.get(step, []), start, end)
        sizes = calls.get(step, [])
        out.append(Split(flight.rank, step, start, end - start, parts, len(sizes), sum(sizes)))
    return out


def attempt_splits(a: Attempt) -> dict[int, list[Split]]:
    """Every rank's complete steps of the attempt, split by part: all of them from the rank's step
    summaries, else (a run from before them) those its rings still hold (`step_splits`)."""
    out = {r: a.summaries.get(r) or step_splits(f) for r, f in sorted(a.flights.items())}
    return {r: s for r, s in out.items() if s}


def coverage(a: Attempt) -> dict[str, Any]:
    """What of the attempt each view can show: per rank, the steps its step summaries cover (every
    step it completed) and those whose individual collectives and phases its rings still hold
    (`Flight.whole_steps`), and a sentence when the rings no longer hold every step."""
    steps = {r: (s[0].step, s[-1].step) for r, s in attempt_splits(a).items()}
    held = {r: f.whole_steps() for r, f in sorted(a.flights.items())}
    short: dict[tuple[int, int], list[int]] = {}
    for r, h in held.items():
        f = a.flights[r]
        if h and (f.issued > f.capacity or f.marked > f.capacity):
            short.setdefault(h, []).append(r)
    capacity = max((f.capacity for f in a.flights.values()), default=0)
    note = None
    if short:
        alike = len(short) == 1 and len(next(iter(short.values()))) == len(held)
        which = "; ".join(f"steps {x}-{y}" + ("" if alike else f" on rank {', '.join(map(str, ranks))}")
                          for (x, y), ranks in sorted(short.items()))
        note = (f"collectives and phases of {which} only: the flight record keeps the last {capacity:,} "
                f"collectives and phase marks per rank (doctor.record_size)")
    return {"steps": steps, "held": held, "capacity": capacity, "note": note}


def slowest_rank(splits: dict[int, list[Split]]) -> dict[str, Any] | None:
    """The rank the others wait for, by how much, and its split; None when no rank stands out
    (or fewer than two ranks have steps in common). The first step in common is left out: it
    warms up (and rank 0 counts its FLOPs in it)."""
    by_step = {r: {s.step: s for s in ss} for r, ss in splits.items()}
    common = sorted(set.intersection(*(set(d) for d in by_step.values()))) if len(by_step) > 1 else []
    common = common[1:]
    if not common:
        return None
    busiest = [max(by_step, key=lambda r: by_step[r][s].busy) for s in common]
    median_busy = {r: statistics.median(by_step[r][s].busy for s in common) for r in by_step}
    step_time = statistics.median(max(by_step[r][s].total for r in by_step) for s in common)
    r = max(median_busy, key=median_busy.__getitem__)
    others = statistics.median(v for k, v in median_busy.items() if k != r)
    share = busiest.count(r) / len(common)
    named = share >= SLOWEST_SHARE and median_busy[r] - others >= SLOWEST_MARGIN * step_time
    return {"rank": r if named else None, "candidate": r, "busy_s": median_busy[r], "others_busy_s": others,
            "excess_s": median_busy[r] - others, "step_s": step_time, "share": share, "steps": len(common),
            "data_s": statistics.median(by_step[r][s].parts["data"] for s in common),
            "others_data_s": statistics.median(by_step[k][s].parts["data"] for k in by_step if k != r for s in common)}


def mean_split(splits: list[Split]) -> dict[str, float]:
    """Mean seconds per step by part (the first step left out where there are more)."""
    use = splits[1:] or splits
    return {p: sum(s.parts[p] for s in use) / len(use) for p in PARTS} if use else dict.fromkeys(PARTS, 0.0)


def collective_totals(flight: Flight, steps: set[int]) -> dict[str, dict[str, float]]:
    """Per kind over the training phases of `steps`: calls, payload bytes, seconds from issue to
    completion, exposed seconds (as in the split)."""
    out: dict[str, dict[str, float]] = {}
    for e in flight.entries:
        if e.step not in steps or e.phase in APART or not e.done:
            continue
        t = out.setdefault(e.kind, {"calls": 0, "bytes": 0, "seconds": 0.0, "exposed_s": 0.0})
        t["calls"] += 1
        t["bytes"] += e.nbytes
        t["seconds"] += e.completed - e.issued
        if e.waited >= 0:
            t["exposed_s"] += e.completed - (e.waited if e.waited > 0 else e.issued)
    return out
