"""The flight file: one rank's heartbeat and its last collectives, in a small file mapped into
memory and updated in place, so that writing it costs no system call and whatever the rank
last wrote survives it (frozen, killed, crashed) for the others and for `shardlab doctor`.

`<run dir>/debug/rank<r>.flight`, little-endian, fixed layout:

  header (HEADER_BYTES)   magic, version, rank, world, pid, attempt, capacity, start time;
                          progress: step, phase, unit, phase start time, last update time;
                          entries issued so far; the watcher's tick, the last dump request
                          answered, the run state (running / finished / failed / preempted)
  ring (capacity x ENTRY_BYTES)  entry n (1-based) lives in slot (n - 1) % capacity: its number,
                          group id, unit id, sequence number in its group, payload bytes, issue
                          and completion times (0: not completed), kind, phase and step, and
                          when this rank began to wait for it (`waited`, below)
  marks (capacity x MARK_BYTES)  mark n lives in slot (n - 1) % capacity: its number, time, step
                          and phase: every phase change and every new step, so the time of each
                          step splits into its phases afterwards (shardlab report, trace)

The rings keep the last `capacity` collectives and marks (doctor.record_size, 4096 by default: a
few hundred steps of a small model, fewer of a large one), so beside them each rank appends one
record per completed step to `<run dir>/debug/rank<r>.steps` ([Note: the step summaries]).

`waited`: 0.0 for a blocking call (the rank waited from its issue), the time its `wait()` began
for an asynchronous one, -1.0 for one completed by a callback this rank never waited on (PyTorch
DDP's bucket futures): the exposed part of a collective is from `waited` (or its issue) to its
completion (docs/observability.md).

Names behind the numbers (groups and their ranks, units, kinds, phases) are in
`rank<r>.meta.json` beside it (worker.py). Times are wall-clock seconds (time.time()), so
ranks on different hosts can be compared to the accuracy of their clocks.

This module is the format and the writer (`FlightRecorder`, one per process: the collectives and
the phase marks write through `RECORDER`); the reader (`read_flight`, `read_step_summaries`) is
doctor/flight_read.py. Both import nothing heavy, so `shardlab doctor` can read a copy of a run
directory anywhere.

[Note: what a heartbeat costs]
A phase mark is one `time.time()` (vDSO, no system call) and one `struct.pack_into` into the
mapping; a collective is two of each (issue, completion) plus a dict lookup for its group's
sequence number. No lock: each field group is written by one `pack_into` under the GIL, and a
reader of a live file may at worst see one entry half written, which the next read corrects.
The kernel writes the dirty pages back on its own schedule (and at exit, also after SIGKILL);
on a shared filesystem other hosts see them after that write-back, or after a dump (msync).
docs/benchmarks.md has the measured cost per call and per step.

[Note: the step summaries]
`rank<r>.steps`: a header (STEPS_MAGIC, rank, attempt), then one STEP_BYTES record per step the
rank completed: the step, flags (STEP_PARTIAL_*: the rings no longer held all of the step when it
ended), its start and wall time, its seconds by part (PARTS: [Note: where a step's time goes] in
observe/runs.py, computed by `split_step`, the function the readers use on the rings) and the
calls and payload bytes of its training collectives. When a step ends (the next step's mark, or
the run's "finish" mark) the recorder reads that step back from its rings, still in memory, and
appends the record with one write: nothing is added to a collective's or a phase mark's cost, a
step pays about 10 µs for 20 collectives and 10 marks (docs/debugging.md, "Limits"), and the file
grows by STEP_BYTES a step (56 MB for a million steps). `shardlab report` reads it for every step's split; the rings
still hold the individual collectives and phases of the last steps (`shardlab trace`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Callable
from typing import Any

MAGIC = b"SHDLFLT1"
VERSION = 2          # 2: the waited time of each entry and the ring of phase marks; 1 is still read
DEFAULT_CAPACITY = 4096

#: Collective kinds, in code order (code = index + 1; 0 = unknown). The first five are shardlab's
#: own collectives'; the others come from torch.distributed called directly (raw_collectives.py).
KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier", "all_to_all", "gather",
         "scatter", "all_gather_object", "broadcast_object", "gather_object", "scatter_object")
#: Phases, in code order (code = index; new ones are appended, so older files read the same). "loop":
#: inside the training loop between the marked phases (the step-boundary agreement, the loss
#: all-reduce); "log": what a step's measurements cost (steps.jsonl, trackers, progress bar).
PHASES = ("startup", "loop", "data", "forward", "backward", "optimizer", "eval", "checkpoint", "finish", "log")
#: Run states in the header.
STATES = ("running", "finished", "failed", "preempted")

#: what a step's time splits into, in report order ([Note: where a step's time goes] in observe/runs.py)
PARTS = ("data", "compute", "comm", "checkpoint", "eval", "log")
#: phases counted as themselves, their collectives included
APART = ("data", "checkpoint", "eval", "log")

_KIND_CODE = {k: i + 1 for i, k in enumerate(KINDS)}
_PHASE_CODE = {p: i for i, p in enumerate(PHASES)}
_APART_CODES = frozenset(_PHASE_CODE[p] for p in APART)
_APART_SET = frozenset(APART)
_OUTSIDE_CODES = frozenset(_PHASE_CODE[p] for p in ("startup", "finish"))   # no step's time

# header: identity (written once), progress (every phase mark), entry count, watcher fields
_IDENTITY = struct.Struct("<8siiiiiid")          # magic version rank world pid attempt capacity started
_PROGRESS = struct.Struct("<qiidd")               # step phase unit phase_since updated
_PROGRESS_AT = 40
_COUNT = struct.Struct("<qd")                     # entries updated
_COUNT_AT = 72
_WATCH = struct.Struct("<dq")                     # tick answered: the watcher thread's alone
_WATCH_AT = 88
_STATE = struct.Struct("<i")                      # run state: the main thread's alone
_STATE_AT = 104
_MARKS = struct.Struct("<q")                      # phase marks written so far: the main thread's alone
_MARKS_AT = 112
HEADER_BYTES = 128
# entry: number gid unit seq nbytes issued completed kind phase step (56 bytes, padded to 64)
_ENTRY = struct.Struct("<qiiqqddhhi")
_COMPLETED = struct.Struct("<d")
_COMPLETED_AT = 40
_WAITED = struct.Struct("<d")
_WAITED_AT = 56
ENTRY_BYTES = 64
# mark: number time step phase
_MARK = struct.Struct("<qdii")
MARK_BYTES = 24
_SLOT = struct.Struct("<qiiqqddhhid")             # a whole entry slot (the entry, then waited): for iter_unpack
# the step summaries ([Note: the step summaries]): header magic rank attempt; per step: step flags
# start total, the PARTS' seconds, calls bytes
STEPS_MAGIC = b"SHDLSTP1"
_STEPS_HEADER = struct.Struct("<8sii")
_STEP = struct.Struct("<iid7fiq")
STEP_BYTES = _STEP.size
STEP_PARTIAL_MARKS = 1      # the ring of marks had lost the step's first marks when it ended
STEP_PARTIAL_ENTRIES = 2    # the ring of collectives had lost some of the step's


def flight_path(debug_dir: str, rank: int) -> str:
    return os.path.join(debug_dir, f"rank{rank}.flight")


def steps_path(flight: str) -> str:
    """The step summaries beside a flight file: rank<r>.steps."""
    return f"{flight[:-len('.flight')] if flight.endswith('.flight') else flight}.steps"


def split_step(spans: list[tuple[float, float, str]], waits: list[tuple[float, float]], start: float,
               end: float) -> dict[str, float]:
    """A step's seconds by part (PARTS), from its phase spans (from, to, phase) and the intervals in
    which the rank waited for a collective of its phases that are not APART ([Note: where a step's
    time goes] in observe/runs.py): the writer's step summaries and the readers' rings alike.
    Exposed communication is the union of the waits within [start, end], in one sweep."""
    parts = dict.fromkeys(PARTS, 0.0)
    for a, b, phase in spans:
        if phase in _APART_SET:
            parts[phase] += b - a
    comm, reach = 0.0, start
    for a, b in sorted(waits):
        if b > end:
            b = end
        if a < reach:
            a = reach
        if b > a:
            comm += b - a
            reach = b
    parts["comm"] = comm
    parts["compute"] = max(0.0, (end - start) - sum(parts.values()))
    return parts


class FlightRecorder:
    """The writer of this process's flight file. Inactive (every call returns at once) until
    `open`; the collectives module calls `issue`/`complete`, the phase marks `enter_phase`."""

    def __init__(self) -> None:
        self.mm: mmap.mmap | None = None
        self.path, self.mapped_file = "", False
        self.capacity = 0
        self.count = 0
        self.marks = 0
        self.steps_fd: int | None = None        # rank<r>.steps ([Note: the step summaries])
        self._step_mark = self._step_entry = 0  # the first mark and entry of the step under way
        self.step = 0
        self.phase = 0
        self.unit = -1
        self.groups: dict[Any, list] = {}        # group as passed (None: the world) -> [gid, last seq]
        self.by_name: dict[str, list] = {}       # process group name -> the same [gid, last seq]
        self.group_names: list[tuple[str, list[int]]] = []   # gid -> (name, global ranks)
        #: set by the worker: group (None: the world) -> (its unique name, its global ranks)
        self.describe_group: Callable[[Any], tuple[str, list[int]]] | None = None
        #: set by the worker: called when a group is seen for the first time (rewrites meta.json)
        self.on_new_group: Callable[[], None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def open(self, path: str, *, rank: int, world: int, attempt: int, capacity: int = DEFAULT_CAPACITY,
             summaries: bool = True) -> None:
        """Create (truncate) the file at `path` and map it. Falls back to anonymous memory when
        the filesystem cannot map files shared (some FUSE mounts): `flush` then writes a copy
        to `path`, which the watcher thread does every few seconds and at every dump. With
        `summaries`, also (truncate) the step summaries beside it ([Note: the step summaries])."""
        self.close()
        if summaries:
            with contextlib.suppress(OSError):  # without the file, no summaries: the rings still work
                fd = os.open(steps_path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
                self.steps_fd = fd
                os.write(fd, _STEPS_HEADER.pack(STEPS_MAGIC, rank, attempt))
        size = HEADER_BYTES + capacity * (ENTRY_BYTES + MARK_BYTES)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, size)
                # reserve the blocks now: a sparse file on a full filesystem maps fine, then kills the
                # process with SIGBUS at the first write to a page it cannot back (seen on a full tmpfs)
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.mapped_file = True
        except OSError:
            self.mm = mmap.mmap(-1, size)
            self.mapped_file = False
        self.path = path
        self.capacity, self.count, self.marks, self.step, self.phase, self.unit = capacity, 0, 0, 0, 0, -1
        self._step_mark = self._step_entry = 0
        self.groups, self.by_name, self.group_names = {}, {}, []
        now = time.time()
        _IDENTITY.pack_into(self.mm, 0, MAGIC, VERSION, rank, world, os.getpid(), attempt, capacity, now)
        _PROGRESS.pack_into(self.mm, _PROGRESS_AT, 0, 0, -1, now, now)
        _COUNT.pack_into(self.mm, _COUNT_AT, 0, now)
        _WATCH.pack_into(self.mm, _WATCH_AT, now, 0)
        _STATE.pack_into(self.mm, _STATE_AT, 0)
        _MARKS.pack_into(self.mm, _MARKS_AT, 0)

    def close(self, state: str | None = None) -> None:
        if self.mm is None:
            return
        if state is not None:
            self.set_state(state)
        if self.phase == _PHASE_CODE["finish"] and self.step > 0 and self.marks > self._step_mark > 0:
            # the run ended well: its last step ended at the "finish" mark
            finished = _MARK.unpack_from(self.mm, self._mark_at(self.marks))[1]
            self._summarize(finished, self.marks - 1)
        if self.steps_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.steps_fd)
            self.steps_fd = None
        with contextlib.suppress(OSError):  # a full filesystem must not fail the run's end
            self.flush()
        self.mm.close()
        self.mm = None
        self.groups, self.by_name = {}, {}   # no reference to a process group outlives the run

    def flush(self) -> None:
        """Make the file current on a shared filesystem: msync, or for an unmapped record a
        whole copy written beside and renamed over it."""
        if self.mm is None:
            return
        if self.mapped_file:
            self.mm.flush()
            return
        with open(f"{self.path}.tmp", "wb") as f:
            f.write(self.mm[:])
        os.replace(f"{self.path}.tmp", self.path)

    @property
    def active(self) -> bool:
        return self.mm is not None

    # -- progress ---------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        if self.mm is None:
            self.step = step
            return
        now = time.time()
        if step != self.step:
            if self.step > 0 and self._step_mark > 0:
                self._summarize(now, self.marks)   # the step under way ends at this mark
            self._step_mark, self._step_entry = self.marks + 1, self.count + 1
        self.step = step
        self._progress(now)

    def enter_phase(self, name: str) -> int:
        """Set the phase (and no unit until a unit's hook says so); returns the previous phase's
        code for `restore_phase`."""
        previous = self.phase
        self.phase, self.unit = _PHASE_CODE[name], -1
        if self.mm is not None:
            self._progress(time.time())
        return previous

    def restore_phase(self, code: int) -> None:
        self.phase, self.unit = code, -1
        if self.mm is not None:
            self._progress(time.time())

    def set_unit(self, unit: int) -> None:
        # no timestamp: a unit label changes only what the next collective records
        self.unit = unit

    def _progress(self, now: float) -> None:
        mm = self.mm
        if mm is not None:
            _PROGRESS.pack_into(mm, _PROGRESS_AT, self.step, self.phase, self.unit, now, now)
            self.marks += 1
            n = self.marks
            _MARK.pack_into(mm, HEADER_BYTES + self.capacity * ENTRY_BYTES + ((n - 1) % self.capacity) * MARK_BYTES,
                            n, now, self.step, self.phase)
            _MARKS.pack_into(mm, _MARKS_AT, n)

    def _mark_at(self, n: int) -> int:
        return HEADER_BYTES + self.capacity * ENTRY_BYTES + ((n - 1) % self.capacity) * MARK_BYTES

    def _summarize(self, end: float, last_mark: int) -> None:
        """The step under way ended at `end`, its last mark `last_mark`: its record, read back from
        the rings, appended to rank<r>.steps ([Note: the step summaries])."""
        mm, cap, fd = self.mm, self.capacity, self.steps_fd
        if mm is None or fd is None:
            return
        flags, first_mark, first_entry = 0, self._step_mark, self._step_entry
        if first_mark <= self.marks - cap:
            flags, first_mark = flags | STEP_PARTIAL_MARKS, self.marks - cap + 1
        if first_entry <= self.count - cap:
            flags, first_entry = flags | STEP_PARTIAL_ENTRIES, self.count - cap + 1
        marks = [(t, ph) for _, t, _, ph in _slots(mm, HEADER_BYTES + cap * ENTRY_BYTES, _MARK, cap, first_mark,
                                                    last_mark)]
        spans = [(t, nxt, PHASES[ph]) for (t, ph), nxt in zip(marks, [t for t, _ in marks[1:]] + [end])
                 if ph not in _OUTSIDE_CODES and nxt >= t]
        if not spans:
            return
        calls = nbytes = 0
        waits = []
        n = first_entry
        for num, _, _, _, size, issued, completed, _, ph, _, waited in _slots(mm, HEADER_BYTES, _SLOT, cap,
                                                                               first_entry, self.count):
            if num == n and completed > 0 and ph not in _APART_CODES and ph not in _OUTSIDE_CODES:
                calls += 1
                nbytes += size
                if waited >= 0:
                    waits.append((waited if waited > 0 else issued, completed))
            n += 1
        start = spans[0][0]
        parts = split_step(spans, waits, start, spans[-1][1])
        with contextlib.suppress(OSError):  # a full filesystem must not fail the run
            os.write(fd, _STEP.pack(self.step, flags, start, spans[-1][1] - start, *(parts[p] for p in PARTS),
                                    calls, nbytes))

    # -- collectives ------------------------------------------------------------------------------
    def issue(self, kind: str, nbytes: int, group: Any) -> int:
        """Enter a collective about to be issued; returns its entry number (0: not recorded)."""
        mm = self.mm
        if mm is None:
            return 0
        g = self.groups.get(group)
        if g is None:
            g = self.groups[group] = self._group_slot(group)
        g[1] += 1
        self.count += 1
        n = self.count
        now = time.time()
        at = HEADER_BYTES + ((n - 1) % self.capacity) * ENTRY_BYTES
        _ENTRY.pack_into(mm, at, n, g[0], self.unit, g[1], nbytes, now, 0.0, _KIND_CODE.get(kind, 0), self.phase,
                         self.step)
        _WAITED.pack_into(mm, at + _WAITED_AT, 0.0)  # a slot reused by the ring keeps no old value
        _COUNT.pack_into(mm, _COUNT_AT, n, now)
        return n

    def _group_slot(self, group: Any) -> list:
        """[gid, last seq] of a group seen for the first time: shared by every handle of the same
        process group (None and the world's object), so its sequence numbers are one series."""
        name, ranks = self.describe_group(group) if self.describe_group else ("?", [])
        slot = self.by_name.get(name)
        if slot is None:
            slot = self.by_name[name] = [len(self.group_names), 0]
            self.group_names.append((name, list(ranks)))
            if self.on_new_group is not None:
                self.on_new_group()
        return slot

    def complete(self, n: int, waited: bool = True) -> None:
        """The collective entered as number `n` returned to this rank (its wait finished).
        waited=False: completed by a callback this rank did not wait on (see `waited` above)."""
        mm = self.mm
        if mm is None or n <= 0 or n <= self.count - self.capacity:
            return
        at = HEADER_BYTES + ((n - 1) % self.capacity) * ENTRY_BYTES
        if not waited:
            _WAITED.pack_into(mm, at + _WAITED_AT, -1.0)
        _COMPLETED.pack_into(mm, at + _COMPLETED_AT, time.time())

    def waiting(self, n: int) -> None:
        """This rank begins to wait for the asynchronous collective entered as number `n`."""
        mm = self.mm
        if mm is None or n <= 0 or n <= self.count - self.capacity:
            return
        _WAITED.pack_into(mm, HEADER_BYTES + ((n - 1) % self.capacity) * ENTRY_BYTES + _WAITED_AT, time.time())

    # -- the watcher thread's fields --------------------------------------------------------------
    def tick(self, answered: int) -> None:
        """The watcher thread ran now (so the process was not stopped) and has answered the dump
        requests up to `answered`."""
        if self.mm is not None:
            _WATCH.pack_into(self.mm, _WATCH_AT, time.time(), answered)

    def set_state(self, state: str) -> None:
        if self.mm is not None:
            _STATE.pack_into(self.mm, _STATE_AT, STATES.index(state))


#: The process's recorder: `engines/collectives.py`, the torch engines' counting hooks and the
#: phase marks (memory.phase_range, LiveMemoryTracker.phase) write through it.
RECORDER = FlightRecorder()


def _slots(mm: Any, base: int, layout: struct.Struct, capacity: int, first: int, last: int) -> list[tuple]:
    """Ring slots `first`..`last` (numbers from 1, the oldest still in the ring), unpacked: one or two
    contiguous runs of slots, whatever the ring's wrap (what a step summary reads back)."""
    if last < first:
        return []
    a, b = (first - 1) % capacity, (last - 1) % capacity + 1
    size = layout.size
    if a < b:
        return list(layout.iter_unpack(mm[base + a * size:base + b * size]))
    return [*layout.iter_unpack(mm[base + a * size:base + capacity * size]),
            *layout.iter_unpack(mm[base:base + b * size])]
