"""The diagnosis as text: one block per rank, then the findings, then the verdict, last, so that
the final line of a failed run names the stuck rank (the launcher prints this in place of
"rank N failed first", which named the first rank to give up: a rank that waited)."""

from __future__ import annotations

import signal
import time

from shardlab.doctor.analysis import (
    Diagnosis,
    Finding,
    RankView,
    fatal_summary,
    main_thread_frames,
    traceback_frames,
)
from shardlab.doctor.flight_read import Entry

STACK_FRAMES = 4   # innermost frames shown per rank


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 10) % 10}"


def since(as_of: float, t: float) -> str:
    """Seconds from t to as_of (clocks of different processes: a hair below zero reads 0)."""
    return f"{max(0.0, as_of - t):.1f} s"


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def collective(v: RankView, e: Entry) -> str:
    """all_gather #9 (group 0 [0, 1], unit blocks.1, forward, step 4, 8.0 KiB)"""
    name, ranks = v.group_of(e)
    unit = v.unit_of(e)
    where = ", ".join(x for x in (f"group {name} {list(ranks)}", f"unit {unit}" if unit else None, e.phase,
                                  f"step {e.step}", size(e.nbytes)) if x)
    return f"{e.kind} #{e.seq} ({where})"


def _exit_text(v: RankView) -> str:
    if v.exit_code is None:
        return ""
    if v.exit_code < 0:
        try:
            text = f"killed by {signal.Signals(-v.exit_code).name}"
        except ValueError:
            text = f"killed by signal {-v.exit_code}"
        return text + (" from the launcher, after the failure" if v.stopped_by_launcher else "")
    return f"exit code {v.exit_code}"


def rank_block(v: RankView, as_of: float) -> list[str]:
    f = v.flight
    if f is None:
        extra = f" ({_exit_text(v)})" if v.exit_code is not None else ""
        return [f"rank {v.rank}: no flight record{extra}: it never reached training, or its files are missing"]
    host = (v.meta or {}).get("host", "?")
    head = f"rank {v.rank} (pid {f.pid} on {host}): {v.status}"
    if v.status == "not running":
        head += f": no heartbeat for {since(as_of, f.tick)} (since {clock(f.tick)})"
    if v.exit is not None:
        head += f": {v.exit.get('message', '')[:300]}"
    if v.exit_code is not None:
        head += f" [{_exit_text(v)}]"
    lines = [head, f"  step {f.step}, phase {f.phase} since {clock(f.phase_since)} ({since(as_of, f.phase_since)})"]
    if v.waiting is not None:
        lines.append(f"  waits in {collective(v, v.waiting)} since {clock(v.waiting.issued)} "
                     f"({since(as_of, v.waiting.issued)})")
        later = v.in_flight[1:]
        if later:  # issued after it, not completed either (the newest is where it blocks, if anywhere)
            lines.append("  also in flight: " + ", ".join(f"{e.kind} #{e.seq} ({size(e.nbytes)}, since "
                                                          f"{clock(e.issued)})" for e in later[-3:]))
    if v.last_done is not None:
        lines.append(f"  last completed: {collective(v, v.last_done)} at {clock(v.last_done.completed)}")
    elif not f.entries:
        lines.append("  no collective recorded yet")
    if v.fatal:
        lines.append(f"  fatal signal: {fatal_summary(v.fatal)}")
    frames, source = _frames(v)
    if frames:
        lines.append(f"  {source}: " + " <- ".join(frames[:STACK_FRAMES]))
    elif v.status in ("running", "not running"):
        lines.append("  no stack dump: it did not answer (stopped, dead, or holding the GIL)"
                     if v.status == "not running" else "  no stack dump yet")
    return lines


def _frames(v: RankView) -> tuple[list[str], str]:
    if v.exit is not None and v.exit.get("traceback"):
        return traceback_frames(v.exit["traceback"]), "traceback"
    if v.stacks:
        return main_thread_frames(v.stacks), "stack (main thread)"
    return [], ""


def verdict(d: Diagnosis) -> str:
    """One line: the culprit(s), where they were, and what the others waited in."""
    if d.kind == "no record":
        return f"no doctor record under {d.run_dir}/debug (the run predates it, or doctor.enabled=false)"
    if d.kind == "finished":
        return "every rank finished"
    if d.kind == "running":
        return "running: no rank waits long for another"
    if not d.findings:
        return "no culprit found: " + ", ".join(f"rank {r} {v.status}" for r, v in d.ranks.items())
    if d.kind == "desync":
        return _desync_verdict(d)
    return "; ".join(_finding_text(d, f) for f in d.findings)


def _finding_text(d: Diagnosis, f: Finding) -> str:
    v = d.ranks[f.rank]
    fl = v.flight
    where = f"at step {fl.step}, phase {fl.phase}" if fl else "before its first step"
    if f.kind == "crashed":
        how = v.exit.get("message") if v.exit else _exit_text(v) or "ended without a record"
        code = f" ({_exit_text(v)})" if v.exit and v.exit_code is not None else ""
        text = f"rank {f.rank} crashed{code} {where}: {how}"
    elif f.kind == "missing":
        text = f"rank {f.rank} is missing: {_exit_text(v) or 'no record'}"
    elif f.kind == "frozen":
        text = (f"rank {f.rank} is stuck (frozen: its process stopped running {since(d.as_of, fl.tick)} before "
                f"{d.as_of_what}) {where}")
    elif f.kind in ("data stall", "checkpoint stall"):
        text = f"rank {f.rank} is stuck ({f.kind}: in phase {fl.phase} for {since(d.as_of, fl.phase_since)}) {where}"
    else:
        text = f"rank {f.rank} is stuck (straggler: running, but it did not reach the collective) {where}"
    waits = [f"rank {w} waited for it in {collective(d.ranks[w], e)} for {since(d.as_of, e.issued)}"
             for w, e in sorted(f.waited_by.items())]
    return text + ("; " + "; ".join(waits) if waits else "")


def _desync_verdict(d: Diagnosis) -> str:
    if d.desync is None:  # every rank waits, each in a different place
        places = []
        for f in d.findings:
            v = d.ranks[f.rank]
            if v.waiting is not None:
                places.append(f"rank {f.rank} in {collective(v, v.waiting)}")
            else:
                frames, _ = _frames(v)
                places.append(f"rank {f.rank} outside the recorded collectives ({frames[0] if frames else '?'})")
        return "desync: the ranks wait in different collectives: " + "; ".join(places)
    x = d.desync
    parts = [f"rank {r} issued {collective(d.ranks[r], e)}" for r, e in sorted(x["entries"].items())]
    return (f"desync at collective #{x['seq']} of group {x['group']} {x['group_ranks']} (the first that differs): "
            + "; ".join(parts))


#: finding kinds that mean a worker was lost: it died without an exception of its own, or hung
LOST_KINDS = ("missing", "frozen", "straggler", "data stall", "checkpoint stall")


def worker_lost(d: Diagnosis) -> bool:
    """Whether the failure lost a worker (killed, out of memory, hung), which a restart from the
    last checkpoint survives; not a desync or an exception raised by the code, which would recur."""
    return any(f.kind in LOST_KINDS or (f.kind == "crashed" and d.ranks[f.rank].exit is None) for f in d.findings)


#: shardlab's errors a user can fix (errors.py): their message says what to do, as in one process
USER_ERRORS = ("CheckpointError", "ConfigError", "DiskFullError")


def user_errors(d: Diagnosis) -> list[str]:
    """When every rank that raised (not counting lost peers) raised one of USER_ERRORS: their
    messages, each once (ranks that refuse a checkpoint together raise the same one); a message
    of several lines (the exit record's `lines`: a full disk's) whole."""
    raised = [v.exit for v in d.ranks.values() if v.exit is not None and not v.exit.get("peer_failure")]
    if not raised or any(e.get("exception") not in USER_ERRORS for e in raised):
        return []
    return list(dict.fromkeys("\n".join(e["lines"]) if e.get("lines") else str(e.get("message", "")).split(": ", 1)[-1]
                              for e in raised))


def key_exception(d: Diagnosis) -> str | None:
    """The one exception that matters, in a line: a culprit's own, else the first a rank raised
    (with a hang, the first rank to give up waiting), with the innermost frame it was raised in."""
    raised = {r: v for r, v in d.ranks.items() if v.exit is not None and v.exit.get("message")}
    if not raised:
        return None
    culprits = [f.rank for f in d.findings if f.rank in raised and not raised[f.rank].exit.get("peer_failure")]
    rank = culprits[0] if culprits else min(raised, key=lambda r: raised[r].exit.get("time", 0.0))
    v = raised[rank]
    frames = traceback_frames(v.exit.get("traceback", ""))
    first = "" if culprits or len(raised) == 1 else " (the first to fail)"
    return f"rank {rank}{first}: {v.exit['message'][:300]}" + (f", at {frames[0]}" if frames else "")


def format_report(d: Diagnosis, with_verdict: bool = True) -> str:
    """The whole report: header, per-rank blocks, diagnosis, and the verdict as the last line."""
    info = d.info
    lines = [f"shardlab doctor: {d.run_dir}"]
    if d.ranks:
        lines[0] += (f" ({d.world} ranks, {info.get('strategy') or '?'}, launch {info.get('launch')}, attempt "
                     f"{info.get('attempt')}, parallel.timeout_s={info.get('timeout_s')}); as of {d.as_of_what}, "
                     f"{clock(d.as_of)}")
    for r in sorted(d.ranks):
        lines.extend(rank_block(d.ranks[r], d.as_of))
    lines.append(f"diagnosis: {d.kind}")
    if with_verdict:
        lines.append(verdict(d))
    return "\n".join(lines)


def live_table(d: Diagnosis) -> str:
    """`--live`: each rank's step, phase, heartbeat and collective (in flight, else the last completed)."""
    rows = [("rank", "state", "step", "phase", "for", "heartbeat", "collective")]
    for r in sorted(d.ranks):
        v, f = d.ranks[r], d.ranks[r].flight
        if f is None:
            rows.append((str(r), v.status, "-", "-", "-", "-", "-"))
            continue
        if v.waiting is not None:
            coll = f"in {collective(v, v.waiting)} for {since(d.as_of, v.waiting.issued)}"
        elif v.last_done is not None:
            coll = f"done {collective(v, v.last_done)}"
        else:
            coll = "-"
        rows.append((str(r), v.status, str(f.step), f.phase, f"{since(d.as_of, f.phase_since)}",
                     f"{since(d.as_of, f.tick)} ago", coll))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in rows)
