"""The doctor inside one worker: it opens the flight file, labels collectives with the unit that
issued them, answers dump requests, and leaves a record of how the worker ended.

Files under `<run dir>/debug/` for rank r (docs/debugging.md):
  rank<r>.flight     heartbeat and the last collectives (flight.py), updated in place
  rank<r>.steps      one summary per completed step: its time by part, its collectives' calls and
                     bytes ([Note: the step summaries] in flight.py), appended
  rank<r>.meta.json  who wrote it (pid, host, launch, attempt) and the names behind the numbers
  rank<r>.stacks.txt every thread's Python stack (faulthandler) at the latest dump
  rank<r>.exit.json  the exception that ended this worker, if one did
  rank<r>.fatal.txt  faulthandler's stacks on a fatal signal (segfault, abort), if one came
  request.json       a dump request (`shardlab doctor RUN_DIR --live`, or a rank that failed)
  tracebacks/<launch>-a<attempt>/rank<r>.txt  the whole traceback of the exception that ended a
                     worker, if one did (written with the doctor on or off, and never moved:
                     [Note: a lost peer's traceback])
A new launch moves the previous files of its rank (but its tracebacks) to
`debug/previous/<launch>-a<attempt>/`.

[Note: who can dump, and when]
A dump is a thread's job, not a signal handler's: the watcher thread wakes every
WATCH_PERIOD_S, writes a tick into the flight file (proof the process was running) and, when
request.json is newer than the last request it answered, writes every thread's stack with
faulthandler. A main thread blocked in a collective releases the GIL, so the watcher runs;
across hosts the request travels through the shared run directory, not through a pid. A
rank that is stopped (SIGSTOP), killed, or hung in C code holding the GIL cannot answer: its
flight file, as it last wrote it, speaks for it, and its tick says since when it did not run.
A rank that fails (an exception, including a collective timeout) writes its exit record and
a request (unless another rank just did: ranks that time out together ask once), and waits
ANSWER_WAIT_S, three watch periods, before it exits, because once it exits the launcher stops
the others. It waits a fixed time rather than reading every rank's file until all answered:
that would be N file reads per poll per failing rank, too many on a shared filesystem at
hundreds of ranks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from shardlab.atomic import write_json_atomic
from shardlab.doctor.flight import KINDS, PHASES, RECORDER, STATES, flight_path

WATCH_PERIOD_S = 0.5
MIRROR_EVERY = 10                # polls between copies of an unmapped flight record (flight.py)
ANSWER_WAIT_S = 3 * WATCH_PERIOD_S   # a failing rank's wait for the others' dumps
REQUEST_FILE = "request.json"
EXITS_FILE = "exits.json"        # written by the launcher: exit codes per rank
RUN_DIR_NOTE_ENV = "SHARDLAB_RUN_DIR_NOTE"   # a `shardlab.torchrun` agent's question: where is the run?
#: "1": a worker that lost its peers prints its traceback on stderr too ([Note: a lost peer's traceback])
VERBOSE_ENV = "SHARDLAB_VERBOSE"
TRACEBACKS = "tracebacks"        # under debug/: <launch>-a<attempt>/rank<r>.txt


def debug_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "debug")


def launch_id() -> str:
    """Shared by every rank of one launch: torchrun's run id, else the parent's pid."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"ppid{os.getppid()}"


def _write_json(path: str, data: Any) -> None:
    write_json_atomic(path, data, default=str)


def request_dump(debug: str, reason: str, by: str, request: int | None = None) -> int:
    """Ask every running rank to dump its stacks; returns the request's id (a time in ns)."""
    request = request or time.time_ns()
    _write_json(os.path.join(debug, REQUEST_FILE), {"id": request, "time": time.time(), "reason": reason, "by": by})
    return request


class Worker:
    """This process's doctor while a run trains (one at a time: `start` replaces a previous one)."""

    def __init__(self, debug: str, rank: int, world: int, attempt: int, info: dict[str, Any], capacity: int):
        self.debug, self.rank, self.world = debug, rank, world
        os.makedirs(debug, exist_ok=True)
        _move_previous(debug, rank)
        self.meta = {"rank": rank, "world": world, "pid": os.getpid(), "host": socket.gethostname(),
                     "launch": launch_id(), "attempt": attempt, "started": time.time(), **info,
                     "kinds": list(KINDS), "phases": list(PHASES), "states": list(STATES),
                     "groups": [], "units": []}
        RECORDER.open(flight_path(debug, rank), rank=rank, world=world, attempt=attempt, capacity=capacity)
        _record_raw_collectives(True)
        RECORDER.describe_group = _describe_group
        RECORDER.on_new_group = self.write_meta
        self.write_meta()
        self.hooks: list[Any] = []
        self.fatal = None
        if not faulthandler.is_enabled():  # a test runner's own handler is left in place
            self.fatal = open(os.path.join(debug, f"rank{rank}.fatal.txt"), "w")
            faulthandler.enable(file=self.fatal, all_threads=True)
        self.stop_event = threading.Event()
        self.answered = 0
        self.own_request = -1     # a request this rank made as it failed: its own watcher skips it
        self.thread = threading.Thread(target=self._watch, name="shardlab-doctor", daemon=True)
        self.thread.start()

    # -- names behind the numbers -----------------------------------------------------------------
    def write_meta(self) -> None:
        self.meta["groups"] = [{"name": n, "ranks": r} for n, r in RECORDER.group_names]
        with contextlib.suppress(OSError):  # called from inside a collective: never fail one
            _write_json(os.path.join(self.debug, f"rank{self.rank}.meta.json"), self.meta)

    def label_units(self, engine: Any) -> None:
        """Label each collective with the wrap unit whose forward or backward was running when it
        was issued: a forward pre-hook (first of all, so it runs before an engine's gather) and,
        for backward, a hook on the unit's output, which autograd calls when backward reaches
        the unit. With prefetch, a gather for the next unit is issued (and labelled) in the one
        before it."""
        names = {id(m): n for n, m in engine.unwrapped().named_modules()}
        units = [names.get(id(u), type(u).__name__) for u in engine.units]
        self.meta["units"] = units
        self.write_meta()
        for uid, unit in enumerate(engine.units):
            self.hooks.append(unit.register_forward_pre_hook(functools.partial(_enter_unit, uid), prepend=True))
            self.hooks.append(unit.register_forward_hook(functools.partial(_leave_unit, uid)))

    # -- the watcher thread -----------------------------------------------------------------------
    def _watch(self) -> None:
        path = os.path.join(self.debug, REQUEST_FILE)
        seen, polls = None, 0
        while not self.stop_event.is_set():
            try:
                stamp = os.stat(path).st_mtime_ns
            except OSError:
                stamp = None
            try:
                if stamp is not None and stamp != seen:
                    seen = stamp
                    self._answer(path)
                RECORDER.tick(self.answered)
                polls += 1
                if not RECORDER.mapped_file and polls % MIRROR_EVERY == 0:  # a filesystem without shared maps
                    RECORDER.flush()
            except (OSError, ValueError):  # a full or vanished filesystem: keep watching, never fail the run
                pass
            self.stop_event.wait(WATCH_PERIOD_S)

    def _answer(self, path: str) -> None:
        try:
            with open(path) as f:
                request = json.load(f)
        except (OSError, ValueError):
            return
        if int(request.get("id", 0)) <= self.answered:
            return
        if int(request["id"]) == self.own_request:  # its exit record says where it was; keep the last dump
            self.answered = self.own_request
            return
        self.dump_stacks(f"request {request['id']} by {request.get('by', '?')}: {request.get('reason', '')}")
        _dump_torch_flight_recorder(self.debug, self.rank)
        RECORDER.flush()
        self.answered = int(request["id"])

    def dump_stacks(self, reason: str) -> str:
        """Every thread's Python stack into rank<r>.stacks.txt (written whole, then renamed)."""
        path = os.path.join(self.debug, f"rank{self.rank}.stacks.txt")
        tmp = f"{path}.tmp"
        threads = ", ".join(f"{t.ident:#018x}={t.name}" for t in threading.enumerate())
        with open(tmp, "w") as f:
            f.write(f"# shardlab doctor: every thread's Python stack, most recent call first\n"
                    f"# rank {self.rank}, pid {os.getpid()}, time {time.time():.3f}, step {RECORDER.step}, "
                    f"phase {PHASES[RECORDER.phase]}\n# reason: {reason}\n# threads: {threads}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, path)
        return path

    # -- the end ----------------------------------------------------------------------------------
    def failed(self, exc: BaseException, peer_failure: bool) -> None:
        """An exception ends this worker: its exit record, then a request to the ranks still
        running to dump their stacks, answered or not within ANSWER_WAIT_S. Best effort: a
        filesystem error here must not replace the exception that ended the run."""
        try:
            last = self._exit_record(exc, peer_failure)
            if self.world > 1:
                path = os.path.join(self.debug, REQUEST_FILE)
                try:
                    fresh = time.time() - os.stat(path).st_mtime < ANSWER_WAIT_S
                except OSError:
                    fresh = False
                if not fresh:  # the ranks timing out together ask once
                    self.own_request = time.time_ns()
                    request_dump(self.debug, f"rank {self.rank} failed: {last[:200]}", f"rank {self.rank}",
                                 self.own_request)
                time.sleep(ANSWER_WAIT_S)
        except (OSError, ValueError):
            pass
        self.stop("failed")

    def _exit_record(self, exc: BaseException, peer_failure: bool) -> str:
        """rank<r>.exit.json; returns the exception's last line (its first line, if several: all of
        them in `lines`, which the launcher prints for an error the user can fix: report.user_errors)."""
        last = (traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines() or [type(exc).__name__])[0]
        lines = str(exc).splitlines()
        _write_json(os.path.join(self.debug, f"rank{self.rank}.exit.json"), {
            "rank": self.rank, "time": time.time(), "exception": type(exc).__name__, "message": last,
            **({"lines": lines[:12]} if len(lines) > 1 else {}),
            "peer_failure": peer_failure, "step": RECORDER.step, "phase": PHASES[RECORDER.phase],
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:]})
        RECORDER.set_state("failed")
        RECORDER.flush()
        return last

    def stop(self, state: str) -> None:
        self.stop_event.set()
        if self.thread is not threading.current_thread():
            self.thread.join(2 * WATCH_PERIOD_S)
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        RECORDER.set_unit(-1)
        _record_raw_collectives(False)
        RECORDER.close(state)
        RECORDER.describe_group = RECORDER.on_new_group = None
        if self.fatal is not None:
            faulthandler.disable()
            self.fatal.close()
            with contextlib.suppress(OSError):
                if os.path.getsize(self.fatal.name) == 0:  # nothing fatal happened: no empty file left behind
                    os.remove(self.fatal.name)


_ACTIVE: Worker | None = None


def start(run_dir: str, rank: int, world: int, attempt: int = 0, *, capacity: int = 4096,
          **info: Any) -> Worker:
    """Start this process's doctor for a run (stopping a previous one left running)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.stop("failed")
    _note_run_dir(run_dir)
    _ACTIVE = Worker(debug_dir(run_dir), rank, world, attempt, info, capacity)
    return _ACTIVE


def active() -> Worker | None:
    return _ACTIVE


def run_built(engine: Any) -> None:
    """The run is built: label its collectives with the engine's units, and enter the loop."""
    if _ACTIVE is not None:
        _ACTIVE.label_units(engine)
    RECORDER.enter_phase("loop")


def finish(state: str = "finished") -> None:
    """The run ended without an exception (finished, or preempted and saved)."""
    global _ACTIVE
    if _ACTIVE is not None:
        RECORDER.enter_phase("finish")
        _ACTIVE.stop(state)
        _ACTIVE = None


@contextlib.contextmanager
def attending(preempted: type[BaseException]) -> Iterator[None]:
    """Around a run: when it ends without an exception ("finished") or with `preempted` (saved,
    then raised), the doctor stops; after any other exception it stays on for `worker_failed`."""
    try:
        yield
    except preempted:
        finish("preempted")
        raise
    finish("finished")


def worker_failed(exc: BaseException, rank: int, distributed: bool, timeout_s: float,
                  traceback_at: str | None = None) -> None:
    """The exception `exc` ends this worker (worker_main calls it before it exits): when it is
    a lost peer, say so first (before the doctor's wait), then the exit record and the request.
    `traceback_at`: where its traceback is, when it is not printed ([Note: a lost peer's traceback])."""
    global _ACTIVE
    peer = distributed and is_peer_failure(exc)
    if peer:
        # no advice here: whether a worker was lost (and a resume helps) is the launcher's verdict
        where = f" Its traceback: {traceback_at} ({VERBOSE_ENV}=1 prints it here)." if traceback_at else ""
        print(f"error: rank {rank}: lost contact with another worker ({peer_cause(str(exc))}); the "
              f"launcher's report (or `shardlab doctor RUN_DIR`) names the rank at fault. Collectives time out "
              f"after parallel.timeout_s={timeout_s:g} s.{where}", file=sys.stderr, flush=True)
    if _ACTIVE is not None:
        _ACTIVE.failed(exc, peer)
        _ACTIVE = None


def is_peer_failure(e: BaseException) -> bool:
    """A collective's error that means another rank is gone or stuck (gloo's and NCCL's wording)."""
    import torch.distributed as dist

    if not isinstance(e, (dist.DistBackendError, RuntimeError)):
        return False
    return isinstance(e, dist.DistBackendError) or reads_as_peer_failure(str(e))


def peer_cause(text: str) -> str:
    """A lost peer's error in a few words: what gloo's or NCCL's message means, with the peer's
    address where it names one (the message itself is in the traceback and the exit record)."""
    low = text.lower()
    found = re.search(r"\[([0-9a-fA-F.:]+)\]:(\d+)", text)
    peer = f" at {found.group(1)}:{found.group(2)}" if found else ""
    if any(s in low for s in ("connection reset", "connection closed", "broken pipe")):
        return f"the worker{peer} closed its connection: its process ended or its host went away"
    if "timed out" in low or "timeout" in low:
        return "a collective timed out waiting for it: it is stuck or gone"
    if "connection refused" in low or "connectfullmesh" in low:
        return f"could not connect to the worker{peer}"
    first = (text.splitlines() or [""])[0]
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)[:200]   # gloo's source location dropped


# [Note: a lost peer's traceback]
# When a peer dies, every survivor's next collective raises (gloo: "Connection reset by peer"),
# and a traceback per survivor says nothing the line above has not: the doctor names the rank at
# fault, and under an elastic agent the run goes on. So a worker that lost its peers writes its
# traceback to <run dir>/debug/tracebacks/<launch>-a<attempt>/rank<r>.txt (`keep_traceback`: a
# path that a restart leaves in place, as the line names it), says where in that one
# line, and exits 1 without printing it. It prints it when asked (SHARDLAB_VERBOSE=1), and when
# its stderr is already a file under the run's debug/ (shardlab's own launcher redirects it
# there, and its --verbose shows those files on the terminal). Any other exception (a bug, a
# config or checkpoint error) is raised as it is: its traceback on stderr, and in the file too.
def keep_traceback(exc: BaseException, run_dir: str, rank: int) -> str | None:
    """`exc`'s whole traceback into <run dir>/debug/tracebacks/<launch>-a<attempt>/rank<r>.txt; its
    path, None if it could not be written."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(debug_dir(run_dir), TRACEBACKS, f"{launch_id()}-a{attempt}", f"rank{rank}.txt")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            f.write(f"# rank {rank}, pid {os.getpid()} on {socket.gethostname()}, launch {launch_id()}, attempt "
                    f"{attempt}, {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n")
            f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        os.replace(f"{path}.tmp", path)
    except OSError:
        return None
    return path


def prints_tracebacks(run_dir: str) -> bool:
    """Whether a lost peer's traceback goes to stderr as well ([Note: a lost peer's traceback])."""
    if os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:  # shardlab's launcher: stderr is debug/workers/.../stderr.log already
        target = os.path.realpath(os.readlink("/proc/self/fd/2"))
    except OSError:
        return False
    return target.startswith(os.path.realpath(debug_dir(run_dir)) + os.sep)


def reads_as_peer_failure(text: str) -> bool:
    """Whether an error's text is gloo's or NCCL's wording for a lost or stuck peer."""
    text = text.lower()
    return any(s in text for s in ("connection reset", "connection closed", "broken pipe", "timed out", "timeout",
                                   "connectfullmesh", "connection refused"))


# ---------------------------------------------------------------------------------------- helpers
def _record_raw_collectives(on: bool) -> None:
    """torch.distributed's collectives called outside shardlab's go into the record while the
    doctor is on (engines/raw_collectives.py; imported here, not at the top: `shardlab doctor`
    reads records without torch)."""
    from shardlab.engines import raw_collectives

    raw_collectives.install() if on else raw_collectives.uninstall()


def _describe_group(group: Any) -> tuple[str, list[int]]:
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    return str(pg.group_name), list(dist.get_process_group_ranks(pg))


def _enter_unit(uid: int, module: Any, args: Any) -> None:
    RECORDER.set_unit(uid)


def _leave_unit(uid: int, module: Any, args: Any, out: Any) -> None:
    RECORDER.set_unit(-1)
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if getattr(first, "requires_grad", False) and first.grad_fn is not None:
        first.register_hook(functools.partial(_backward_reaches, uid))


def _backward_reaches(uid: int, grad: Any) -> None:
    RECORDER.set_unit(uid)


def _note_run_dir(run_dir: str) -> None:
    """Local rank 0 tells a `shardlab.torchrun` agent where the run directory is (doctor/agent.py)."""
    note = os.environ.get(RUN_DIR_NOTE_ENV)
    if note and os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            with open(note, "w") as f:
                f.write(os.path.abspath(run_dir))
        except OSError:  # the agent then prints torchrun's own message only
            pass


def _move_previous(debug: str, rank: int) -> None:
    """An earlier launch's (or attempt's) files of this rank go to debug/previous/<launch>-a<k>/."""
    meta_path = os.path.join(debug, f"rank{rank}.meta.json")
    try:
        with open(meta_path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return
    dest = os.path.join(debug, "previous", f"{old.get('launch', 'unknown')}-a{old.get('attempt', 0)}")
    os.makedirs(dest, exist_ok=True)
    for suffix in ("flight", "steps", "meta.json", "stacks.txt", "exit.json", "fatal.txt", "torch-fr.json"):
        src = os.path.join(debug, f"rank{rank}.{suffix}")
        if os.path.exists(src):
            shutil.move(src, os.path.join(dest, os.path.basename(src)))


def _dump_torch_flight_recorder(debug: str, rank: int) -> None:
    """PyTorch's own flight recorder, when the user turned it on (TORCH_FR_BUFFER_SIZE): every
    collective of every process group, also those shardlab's record does not see (the loop's
    loss all-reduce, checkpoint collectives). Read it with torch's `torchfrtrace`."""
    if not int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0):
        return
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        text = _dump_fr_trace_json(True, True)
    except Exception:  # noqa: BLE001 - a missing or failing recorder must not break a dump
        return
    path = os.path.join(debug, f"rank{rank}.torch-fr.json")
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)
