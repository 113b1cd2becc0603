"""The hang doctor: which rank is stuck, and where every rank waits (docs/debugging.md).

Three layers, each in its own module:
- flight.py: each rank's heartbeat (step, phase) and ring of its last collectives, in a file
  mapped into memory and updated in place (no system call per update). The collectives
  (engines/collectives.py, and the torch engines' counting hooks) and the phase marks
  (memory.phase_range, LiveMemoryTracker.phase) write through `flight.RECORDER`.
- worker.py: the run's side in each worker: the flight file and its names, unit labels, a
  watcher thread that answers dump requests with every thread's stack, the exit record.
- analysis.py and report.py: read only files under `<run dir>/debug/` and say who is stuck,
  where the others wait, and why (frozen, straggler, desync, crashed, data or checkpoint
  stall). `shardlab doctor RUN_DIR [--live]` (cli.py) and the launcher print it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shardlab.doctor.flight import RECORDER


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase in this rank's heartbeat (one of flight.PHASES); the previous one comes back
    when the block ends normally. The memory tracker's and profiler's phase marks call it.
    Not in a `finally`: an exception leaves the phase it was raised in, which the exit record
    and the diagnosis then report (a timeout in backward says "backward", not "loop")."""
    previous = RECORDER.enter_phase(name)
    yield
    RECORDER.restore_phase(previous)


__all__ = ["RECORDER", "phase"]
