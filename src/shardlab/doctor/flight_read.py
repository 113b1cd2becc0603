"""Reading a flight file and a step summaries file (the format and the writer: doctor/flight.py):
`read_flight` gives a rank's `Flight` (its heartbeat, its ring of `Entry`s and of `Mark`s),
`read_step_summaries` its `StepSummary`s. Standard library only, like the writer.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.doctor.flight import (
    _COUNT,
    _COUNT_AT,
    _ENTRY,
    _IDENTITY,
    _MARK,
    _MARKS,
    _MARKS_AT,
    _PROGRESS,
    _PROGRESS_AT,
    _STATE,
    _STATE_AT,
    _STEP,
    _STEPS_HEADER,
    _WAITED,
    _WAITED_AT,
    _WATCH,
    _WATCH_AT,
    ENTRY_BYTES,
    HEADER_BYTES,
    KINDS,
    MAGIC,
    MARK_BYTES,
    PARTS,
    PHASES,
    STATES,
    STEP_BYTES,
    STEPS_MAGIC,
    VERSION,
)


@dataclass(frozen=True)
class Entry:
    number: int          # 1-based, in issue order on this rank
    group: int           # group id (meta.json names its ranks)
    unit: int            # unit id (-1: none)
    seq: int             # sequence number within the group, 1-based, same on every member
    nbytes: int          # payload bytes (collectives.py's convention)
    issued: float
    completed: float     # 0.0: never completed
    kind: str
    phase: str
    step: int

    waited: float = 0.0  # 0.0: blocking; > 0: when its wait began; -1.0: completed by a callback

    @property
    def done(self) -> bool:
        return self.completed > 0


@dataclass(frozen=True)
class Mark:
    """A phase change or a new step: from `time` on, the rank was in `phase` of `step`."""

    number: int
    time: float
    step: int
    phase: str


@dataclass(frozen=True)
class Flight:
    rank: int
    world: int
    pid: int
    attempt: int
    capacity: int
    started: float
    step: int
    phase: str
    unit: int
    phase_since: float
    updated: float          # the main thread's last write (phase mark or collective)
    issued: int             # entries issued so far (the ring keeps the last `capacity`)
    tick: float             # the watcher thread's last tick: the process was running then
    answered: int           # the last dump request answered
    state: str
    entries: tuple[Entry, ...]   # oldest first
    marks: tuple[Mark, ...] = ()  # oldest first (format 2; none in a format 1 file)
    marked: int = 0               # phase marks written so far (the ring keeps the last `capacity`)

    def whole_steps(self) -> tuple[int, int] | None:
        """The first and last step whose collectives and phase marks the rings still hold whole
        (None: no step recorded); earlier steps were overwritten (`capacity`, doctor.record_size)."""
        steps = [m.step for m in self.marks if m.step > 0]
        if not steps:
            return None
        first = steps[0] + (1 if self.marked > self.capacity else 0)
        if self.issued > self.capacity and self.entries:
            first = max(first, self.entries[0].step + 1)
        return (first, steps[-1]) if first <= steps[-1] else None


@dataclass(frozen=True)
class StepSummary:
    """One step of a rank as its step summaries hold it ([Note: the step summaries])."""

    step: int
    flags: int           # STEP_PARTIAL_*: 0 when the rings held all of the step
    start: float
    total: float
    parts: dict[str, float]
    calls: int           # the training collectives' calls and payload bytes (not APART's)
    nbytes: int


def read_step_summaries(path: str) -> list[StepSummary]:
    """A rank<r>.steps file, oldest step first ([] when it is missing or not one; a record being
    written is left out)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if len(data) < _STEPS_HEADER.size or data[:8] != STEPS_MAGIC:
        return []
    body = data[_STEPS_HEADER.size:]
    body = body[:len(body) - len(body) % STEP_BYTES]
    return [StepSummary(step, flags, start, total, dict(zip(PARTS, parts)), calls, nbytes)
            for step, flags, start, total, *parts, calls, nbytes in _STEP.iter_unpack(body)]


def read_flight(path: str) -> Flight:
    """Parse a flight file (raises ValueError when it is not one)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_BYTES or data[:8] != MAGIC:
        raise ValueError(f"{path} is not a shardlab flight file")
    _, version, rank, world, pid, attempt, capacity, started = _IDENTITY.unpack_from(data, 0)
    if version not in (1, VERSION):
        raise ValueError(f"{path}: flight format version {version}, this shardlab reads 1 and {VERSION}")
    step, phase, unit, since, updated = _PROGRESS.unpack_from(data, _PROGRESS_AT)
    count, last_issue = _COUNT.unpack_from(data, _COUNT_AT)
    tick, answered = _WATCH.unpack_from(data, _WATCH_AT)
    (state,) = _STATE.unpack_from(data, _STATE_AT)
    entries = []
    for n in range(max(1, count - capacity + 1), count + 1):
        off = HEADER_BYTES + ((n - 1) % capacity) * ENTRY_BYTES
        if off + ENTRY_BYTES > len(data):
            break
        num, gid, u, seq, nbytes, issued, completed, kind, ph, st = _ENTRY.unpack_from(data, off)
        if num != n:  # being written at the moment of reading (a live file)
            continue
        (waited,) = _WAITED.unpack_from(data, off + _WAITED_AT)
        entries.append(Entry(num, gid, u, seq, nbytes, issued, completed,
                             KINDS[kind - 1] if 0 < kind <= len(KINDS) else "unknown", _phase_name(ph), st,
                             waited if version > 1 else 0.0))
    marks = _read_marks(data, capacity) if version > 1 else ()
    marked = _MARKS.unpack_from(data, _MARKS_AT)[0] if version > 1 else 0
    return Flight(rank, world, pid, attempt, capacity, started, step, _phase_name(phase), unit, since,
                  max(updated, last_issue), count, tick, answered,
                  STATES[state] if 0 <= state < len(STATES) else "unknown", tuple(entries), marks, marked)


def _phase_name(code: int) -> str:
    return PHASES[code] if 0 <= code < len(PHASES) else "unknown"


def _read_marks(data: bytes, capacity: int) -> tuple[Mark, ...]:
    (count,) = _MARKS.unpack_from(data, _MARKS_AT)
    base, marks = HEADER_BYTES + capacity * ENTRY_BYTES, []
    for n in range(max(1, count - capacity + 1), count + 1):
        off = base + ((n - 1) % capacity) * MARK_BYTES
        if off + MARK_BYTES > len(data):
            break
        num, t, step, ph = _MARK.unpack_from(data, off)
        if num == n:  # else: being written at the moment of reading
            marks.append(Mark(num, t, step, _phase_name(ph)))
    return tuple(marks)
