"""Diagnose a run from the files under `<run dir>/debug/` alone (so it works live, after a crash,
and on a copy of a cluster's run directory): who is stuck or missing and where it was, the
collective every other rank waits in, and a classification.

[Note: how the culprit is found]
Every member of a process group issues that group's collectives in the same order, so the
flight records number them per group (seq 1, 2, ...) and the numbers agree across ranks. Then:
1. desync: the first sequence number, in some group, where the members' records disagree on
   the kind or the size of the collective. Two ranks are then inside different collectives
   (or the same one with different sizes) and either hang or fail; neither is "slow".
2. crashed: a rank ended by an exception other than a lost peer (its exit record), by an exit
   code without one, or by a signal (the launcher's exits.json).
3. otherwise the ranks that wait: a rank waits in its oldest collective not completed. A
   member of that group that never issued that sequence number is behind: the one the others
   wait for. If its process stopped running (its watcher thread stopped ticking, e.g. SIGSTOP, a
   dead host) it is frozen, whatever its phase; else its phase says why: data loading (data
   stall), a checkpoint (checkpoint stall); and if it ran but did not arrive, a straggler.
A rank whose exception is a lost peer (a collective timeout, a closed connection) waited: it
is never the culprit.

The moment the diagnosis speaks of (`as_of`): the first failure (the earliest exit record),
else now for a live run, else the last sign of life of any rank.
"""

from __future__ import annotations

import glob
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from shardlab.atomic import read_json
from shardlab.doctor.flight_read import Entry, Flight, read_flight
from shardlab.doctor.worker import EXITS_FILE, WATCH_PERIOD_S, debug_dir

#: A rank whose watcher has not ticked for this long was not running (stopped, dead, or hung
#: holding the GIL): a few watch periods, so a busy machine's scheduling delays do not count.
NOT_RUNNING_AFTER_S = 6 * WATCH_PERIOD_S


@dataclass
class RankView:
    rank: int
    meta: dict[str, Any] | None = None
    flight: Flight | None = None
    exit: dict[str, Any] | None = None        # rank<r>.exit.json
    stacks: str | None = None                 # rank<r>.stacks.txt
    fatal: str | None = None                  # rank<r>.fatal.txt, when faulthandler wrote one (a fatal signal)
    exit_code: int | None = None              # from the launcher (negative: killed by that signal)
    exit_second: int | None = None            # when the launcher saw it exit (whole seconds)
    stopped_by_launcher: bool = False         # killed by the launcher after another rank failed
    status: str = "missing"                   # see _status
    waiting: Entry | None = None              # the oldest collective not completed
    in_flight: list[Entry] = field(default_factory=list)   # every one not completed, oldest first
    last_done: Entry | None = None            # the last collective completed

    def group_of(self, e: Entry) -> tuple[str, tuple[int, ...]]:
        groups = (self.meta or {}).get("groups", [])
        g = groups[e.group] if 0 <= e.group < len(groups) else {"name": f"?{e.group}", "ranks": []}
        return g["name"], tuple(g["ranks"])

    def unit_of(self, e: Entry) -> str | None:
        units = (self.meta or {}).get("units", [])
        return units[e.unit] if 0 <= e.unit < len(units) else None


@dataclass
class Finding:
    """One culprit: a rank and what happened to it."""

    rank: int
    kind: str                 # crashed | desync | frozen | straggler | data stall | checkpoint stall | missing
    waited_by: dict[int, Entry] = field(default_factory=dict)   # waiting rank -> the collective it waits in


@dataclass
class Diagnosis:
    run_dir: str
    kind: str                 # the first finding's kind, or: finished | running | no record | unknown
    as_of: float
    as_of_what: str
    ranks: dict[int, RankView]
    findings: list[Finding]
    desync: dict[str, Any] | None = None   # group, ranks, seq, per-rank entries
    world: int = 0
    info: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ loading
def load(run_dir: str) -> dict[int, RankView]:
    """Every rank of the newest launch that left files under <run dir>/debug/."""
    debug = debug_dir(run_dir)
    metas = {}
    for path in glob.glob(os.path.join(debug, "rank*.meta.json")):
        meta = read_json(path)
        if meta is not None and isinstance(meta.get("rank"), int):
            metas[meta["rank"]] = meta
    if not metas:
        return {}
    newest = max(metas.values(), key=lambda m: m.get("started", 0))
    launch, world = newest.get("launch"), int(newest.get("world", 1))
    exits = read_json(os.path.join(debug, EXITS_FILE)) or {}
    codes = exits.get("ranks", {}) if exits.get("launch") in (None, launch) else {}
    views = {}
    for r in range(world):
        v = RankView(r)
        meta = metas.get(r)
        if meta is not None and meta.get("launch") == launch:
            v.meta = meta
            try:
                v.flight = read_flight(os.path.join(debug, f"rank{r}.flight"))
            except (OSError, ValueError):
                v.flight = None
            v.exit = read_json(os.path.join(debug, f"rank{r}.exit.json"))
            v.stacks = _read_text(os.path.join(debug, f"rank{r}.stacks.txt"))
            v.fatal = _read_text(os.path.join(debug, f"rank{r}.fatal.txt")) or None
        code = codes.get(str(r))
        if isinstance(code, dict):
            v.exit_code, v.exit_second = code.get("exitcode"), code.get("timestamp")
        views[r] = v
    _mark_launcher_stops(views)
    return views


def _mark_launcher_stops(views: dict[int, RankView]) -> None:
    """Once a worker fails, torch's agent stops the others: SIGTERM, and SIGKILL 30 s later for
    one that did not exit (a SIGSTOPped one). Those exits are the launcher's, not failures: a
    SIGTERM always (nothing else in a run sends one but a scheduler's stop), a SIGKILL when it
    came after the first exit (an earlier SIGKILL is the out-of-memory killer's, or a user's).
    The rank's state is then what its flight record says."""
    seconds = [v.exit_second for v in views.values() if isinstance(v.exit_second, (int, float))]
    first = min(seconds) if seconds else None
    for v in views.values():
        if v.exit_code == -15 or (v.exit_code == -9 and first is not None and v.exit_second is not None
                                  and v.exit_second > first):
            v.stopped_by_launcher = True


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------- diagnosis
def diagnose(run_dir: str, now: float | None = None, live: bool = False) -> Diagnosis:
    """The diagnosis of the run in `run_dir` (live: as of now, for a run still going)."""
    ranks = load(run_dir)
    if not ranks:
        return Diagnosis(run_dir, "no record", now or time.time(), "now", {}, [])
    failures = [v.exit["time"] for v in ranks.values() if v.exit and "time" in v.exit]
    if failures and not live:
        as_of, what = min(failures), "the first failure"
    elif live or not any(v.flight for v in ranks.values()):
        as_of, what = now or time.time(), "now"
    else:
        as_of, what = max(max(v.flight.tick, v.flight.updated) for v in ranks.values() if v.flight), \
            "the last sign of life"
    for v in ranks.values():
        v.status = _status(v, as_of)
        if v.flight is not None:
            v.in_flight = [e for e in v.flight.entries if not e.done]
            v.waiting = v.in_flight[0] if v.in_flight else None
            done = [e for e in v.flight.entries if e.done]
            v.last_done = max(done, key=lambda e: e.completed) if done else None
    first = next((v.meta for v in ranks.values() if v.meta), {})
    d = Diagnosis(run_dir, "unknown", as_of, what, ranks, [], world=len(ranks),
                  info={k: first.get(k) for k in ("strategy", "timeout_s", "launch", "attempt")})
    d.desync = find_desync(ranks)
    d.findings = _culprits(ranks, d.desync)
    if d.findings:
        d.kind = d.findings[0].kind
    elif all(v.status in ("finished", "preempted") for v in ranks.values()):
        d.kind = "finished"
    elif all(v.status == "running" for v in ranks.values()) and not _long_waits(ranks, as_of):
        d.kind = "running"
    return d


def _status(v: RankView, as_of: float) -> str:
    """missing | finished | preempted | gave up (waited: its collective timed out, or a peer was lost) |
    crashed | killed | not running | running"""
    f = v.flight
    if v.meta is None or f is None:
        return "killed" if v.exit_code is not None and v.exit_code < 0 and not v.stopped_by_launcher else "missing"
    if f.state in ("finished", "preempted"):
        return f.state
    if v.exit is not None:
        return "gave up" if v.exit.get("peer_failure") else "crashed"
    if v.exit_code is not None and not v.stopped_by_launcher:
        return "killed" if v.exit_code < 0 else "crashed"
    return "not running" if as_of - f.tick > NOT_RUNNING_AFTER_S else "running"


def _long_waits(ranks: dict[int, RankView], as_of: float) -> bool:
    return any(v.waiting is not None and as_of - v.waiting.issued > NOT_RUNNING_AFTER_S for v in ranks.values())


def _by_group(v: RankView) -> dict[tuple[str, tuple[int, ...]], dict[int, Entry]]:
    out: dict[tuple[str, tuple[int, ...]], dict[int, Entry]] = {}
    for e in v.flight.entries if v.flight else ():
        out.setdefault(v.group_of(e), {})[e.seq] = e
    return out


def find_desync(ranks: dict[int, RankView]) -> dict[str, Any] | None:
    """The first sequence number (lowest issue time across groups) where a group's members'
    records disagree on the kind or size of the collective, or None."""
    per_rank = {r: _by_group(v) for r, v in ranks.items() if v.flight is not None}
    groups = {g for seqs in per_rank.values() for g in seqs}
    found = []
    for g in groups:
        members = [r for r in g[1] if r in per_rank and g in per_rank[r]]
        if len(members) < 2:
            continue
        records = [per_rank[r][g] for r in members]
        low, high = max(min(s) for s in records), min(max(s) for s in records)
        for seq in range(low, high + 1):
            entries = {r: per_rank[r][g].get(seq) for r in members}
            if any(e is None for e in entries.values()):
                continue
            if len({(e.kind, e.nbytes) for e in entries.values()}) > 1:
                found.append({"group": g[0], "group_ranks": list(g[1]), "seq": seq, "entries": entries,
                              "issued": min(e.issued for e in entries.values())})
                break
    return min(found, key=lambda f: f["issued"]) if found else None


def _culprits(ranks: dict[int, RankView], desync: dict[str, Any] | None) -> list[Finding]:
    findings: dict[int, Finding] = {}
    if desync is not None:
        for r in desync["entries"]:
            findings[r] = Finding(r, "desync")
    for r, v in ranks.items():
        if v.status in ("crashed", "killed", "missing") and r not in findings:
            findings[r] = Finding(r, "missing" if v.status == "missing" else "crashed")
    _behind(ranks, findings)
    if not findings:
        _fallback(ranks, findings)
    for f in findings.values():  # who waited in a collective the culprit never finished
        for w, wv in ranks.items():
            if w != f.rank and w not in f.waited_by and wv.waiting is not None \
                    and f.rank in wv.group_of(wv.waiting)[1] and w not in findings:
                f.waited_by[w] = wv.waiting
    order = {"desync": 0, "crashed": 1, "missing": 2}
    return sorted(findings.values(), key=lambda f: (order.get(f.kind, 3), f.rank))


def _waits(v: RankView) -> bool:
    """Whether a rank was itself waiting: in a recorded collective, or failed on a lost peer."""
    return v.waiting is not None or v.status == "gave up"


def _behind(ranks: dict[int, RankView], findings: dict[int, Finding]) -> None:
    """Step 3 of [Note: how the culprit is found]: the members that never issued the collective
    another rank waits in. One that waits itself (elsewhere) is a link of a chain, not its end."""
    issued_max = {r: {g: max(s) for g, s in _by_group(v).items()} for r, v in ranks.items()}
    for w, wv in ranks.items():
        if wv.waiting is None or wv.status in ("crashed", "killed"):
            continue
        g = wv.group_of(wv.waiting)
        for r in g[1]:
            if r == w or r not in ranks or issued_max.get(r, {}).get(g, 0) >= wv.waiting.seq:
                continue
            if r not in findings and _waits(ranks[r]):
                continue
            findings.setdefault(r, Finding(r, _why_behind(ranks[r]))).waited_by[w] = wv.waiting


def _fallback(ranks: dict[int, RankView], findings: dict[int, Finding]) -> None:
    """No rank is behind in the record, yet some rank gave up or waits long (it waits in a
    collective outside the record, or a stopped rank is inside one): a rank whose process
    stopped running; else one that neither waits nor finished; else, when every rank waits
    in a different place, the ranks are in different collectives: a desync."""
    if not any(v.status == "gave up" or v.waiting is not None for v in ranks.values()):
        return
    alive = {r: v for r, v in ranks.items() if v.status not in ("finished", "preempted")}
    stopped = [r for r, v in alive.items() if v.status == "not running"]
    idle = [r for r, v in alive.items() if not _waits(v)]
    for r in stopped or idle:
        findings[r] = Finding(r, _why_behind(ranks[r]))
    if not findings and len(alive) > 1:
        for r in alive:
            findings[r] = Finding(r, "desync")


def _why_behind(v: RankView) -> str:
    # a process that does not run is frozen whatever its phase (a SIGSTOP can land during data
    # loading: the verdict's "phase data" says where); a stall is a running process stuck in a phase
    if v.status == "not running":
        return "frozen"
    phase = v.flight.phase if v.flight else None
    if phase == "data":
        return "data stall"
    if phase == "checkpoint":
        return "checkpoint stall"
    return "straggler"


# ------------------------------------------------------------------------------------ stack reading
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def main_thread_frames(stacks: str) -> list[str]:
    """The main thread's frames in a faulthandler dump, innermost first ("file:line in func")."""
    names = {}
    for line in stacks.splitlines():
        if line.startswith("# threads:"):
            for item in line.split(":", 1)[1].split(","):
                ident, _, name = item.strip().partition("=")
                if ident:
                    names[int(ident, 16)] = name
    frames: list[str] = []
    current = None
    for line in stacks.splitlines():
        m = _THREAD.match(line)
        if m:
            current = names.get(int(m.group(1), 16))
            continue
        f = _FRAME.match(line)
        if f and current == "MainThread" and not _plumbing(f.group(1)):
            frames.append(f"{_short(f.group(1))}:{f.group(2)} in {f.group(3)}")
    return frames


def fatal_summary(text: str) -> str:
    """faulthandler's report of a fatal signal: its first line and the crashing thread's frames."""
    lines = text.splitlines()
    frames, current = [], False
    for line in lines:
        if _THREAD.match(line):
            current = line.startswith("Current thread")
            continue
        f = _FRAME.match(line)
        if f and current:
            frames.append(f"{_short(f.group(1))}:{f.group(2)} in {f.group(3)}")
    return " <- ".join([lines[0].strip() if lines else "", *frames[:4]])


def traceback_frames(text: str) -> list[str]:
    """An exception traceback's frames, innermost first (without the doctor's own wrapper of
    torch.distributed, which every collective passes through)."""
    frames = [f"{_short(m.group(1))}:{m.group(2)} in {m.group(3)}"
              for m in re.finditer(r'File "(.*)", line (\d+), in (.*)', text) if not _plumbing(m.group(1))]
    return frames[::-1]


def _plumbing(path: str) -> bool:
    return path.endswith(os.path.join("engines", "raw_collectives.py"))


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
