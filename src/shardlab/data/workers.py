"""The worker processes of `shardlab prepare` (data/prepare.py): the pool, what each worker is
doing, and waits that end.

[Note: bounded waits] multiprocessing's Pool waits for a result forever: a worker killed by the
kernel (out of memory) takes its task with it and the pool starts another worker, so the result
never comes; a task lost any other way looks the same; and Pool.terminate() blocks for good on
the queue's lock when a worker died holding it. Here every wait is a loop of POLL_S waits, and
each worker writes to a shared board what it is doing (its pid, and: sniffing inputs, unit N,
the SHA-256 of input N, or idle). Between two waits the parent checks the board:
- a worker that has exited stops the prepare at once, naming its pid, how it ended and its task;
- no result for LOST_S while every worker is idle stops it too (a lost task);
- a worker on a task that has used no CPU time for STUCK_S (Linux: /proc) is stuck, not slow
  (a lock inherited at fork, a dead pipe): its stack is printed (SIGUSR1: faulthandler, which
  each worker registers) and the prepare stops, naming the worker and the task;
- a task running for SLOW_S (and each SLOW_S after) prints a line naming it, the worker and the
  unit's inputs: slow is not wrong (a 10 GiB .json.gz is one unit), so it does not stop.
Closing the pool is given CLOSE_S, after which its workers are killed and the prepare says so.
The stress script for a stall a user met (1 prepare in 34 never ended): data/stress.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shardlab.data.shards import DataError

POLL_S = 2.0
LOST_S = 120.0
STUCK_S = 300.0
SLOW_S = 600.0
CLOSE_S = 10.0
SNIFF = 1 << 40  # the board's code for sniffing; a unit N is N + 1, the hash of input N is -(N + 1)

_BOARD: Any = None  # in a worker: the shared board and this worker's slot in it
_SLOT = -1


def init_worker() -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core per worker (data/prepare.py's docstring)


_STACK: Any = None
#: how long the parent waits for a stuck worker's stack: a hang guard (the dump is a signal handler's write)
STACK_WAIT_S = 60.0


def stack_path(pid: int) -> str:
    """Where worker `pid` writes its stack when the parent asks (SIGUSR1)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"shardlab-prepare-stack-{pid}.txt")


def _print_stack(pid: int) -> None:
    """Ask worker `pid` for its stack and print it to stderr once written (STACK_WAIT_S at most)."""
    path = stack_path(pid)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + STACK_WAIT_S
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.2)
            with open(path) as f:
                now = f.read()
            if now and now == text:   # written, and no longer growing (the handler writes thread by thread)
                sys.stderr.write(now)
                sys.stderr.flush()
                return
            text = now


def _init_pool_worker(board) -> None:
    global _BOARD, _SLOT
    init_worker()
    if hasattr(signal, "SIGUSR1"):  # the parent asks for a stuck worker's stack (see the Note)
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)   # kill -USR1: to stderr, as the parent's
        global _STACK
        # SIGUSR2, the parent's stuck check: to a file it prints once written, not to stderr after a
        # fixed wait (on a busy machine the dump can come after any wait the parent would choose)
        _STACK = open(stack_path(os.getpid()), "w")  # noqa: SIM115 - open for the worker's life
        faulthandler.register(signal.SIGUSR2, file=_STACK, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool's terminate() (not the parent's handler: run)
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent, even when it is SIGKILLed
        # a split input's unit arrives as one message of up to 16 MiB (data/units.py): glibc would
        # map and fault in fresh pages for each one (its threshold is 128 KiB in a fresh process);
        # kept in the heap they are reused (measured: ~70,000 fewer page faults per 256 MiB)
        if hasattr(libc, "mallopt"):  # glibc
            libc.mallopt(-3, 32 << 20)   # M_MMAP_THRESHOLD: glibc's largest
            libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD: the heap is not handed back between units
    with board.get_lock():
        k = board[0]
        board[0] = k + 1
    if 2 + 2 * k < len(board):  # a replacement worker (after a death) gets no slot: the prepare stops anyway
        _BOARD, _SLOT = board, 1 + 2 * k
        board[_SLOT] = os.getpid()


class doing:
    """`with doing(code):` this worker's task on the board (see SNIFF), idle again after it."""

    def __init__(self, code: int):
        self.code = code

    def __enter__(self) -> None:
        if _BOARD is not None:
            _BOARD[_SLOT + 1] = self.code

    def __exit__(self, *exc) -> None:
        if _BOARD is not None:
            _BOARD[_SLOT + 1] = 0


def _sniffing(fn: Callable, item: Any) -> Any:
    with doing(SNIFF):
        return fn(item)


def _ended(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        why = " (the kernel's out-of-memory killer sends it: see dmesg; lower --workers or --shard-mb)" \
            if name == "SIGKILL" else ""
        return f"was killed by {name}{why}"
    return f"exited with status {code}"


class Workers:
    """A process pool whose waits end (see the Note); a context manager that closes it."""

    def __init__(self, n: int):
        # fork: nothing here has used the tokenizer's Rust threads, so the children start clean and fast
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        self.board = ctx.Array("q", 1 + 2 * n)
        self.pool = ctx.Pool(n, initializer=_init_pool_worker, initargs=(self.board,))
        self.procs = list(self.pool._pool)
        self.names: dict[int, str] = {}  # a task's code -> what it reads (for messages)
        try:  # a split input's units go through the pool's task pipe (data/units.py), up to 16 MiB each:
            # 1 MiB at a time (Linux's default is 64 KiB) takes 16x fewer writes and reads, each of which
            # the sending thread must take the GIL for (measured, 256 MiB .jsonl.zst at 2 workers, 8
            # alternating runs: median 1.58 s without, 1.48 s with). The pool's own pipe: where it is
            # not there (another Python), only that saving is lost.
            import fcntl

            fcntl.fcntl(self.pool._inqueue._writer.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except (ImportError, AttributeError, OSError):
            pass

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        for p in {*self.procs, *self.pool._pool}:   # the first workers and any that replaced one
            with contextlib.suppress(OSError, TypeError):
                os.remove(stack_path(p.pid))
        stop = threading.Thread(target=self.pool.terminate, daemon=True, name="shardlab-pool-close")
        stop.start()
        stop.join(CLOSE_S)
        if stop.is_alive():
            for p in self.procs:
                if p.exitcode is None:
                    p.kill()
            print(f"prepare: the worker pool did not close in {CLOSE_S:.0f} s; its workers were killed",
                  file=sys.stderr)

    def map(self, fn: Callable, items: list, chunksize: int = 1) -> list:
        import functools

        pending = self.pool.map_async(functools.partial(_sniffing, fn), items, chunksize)
        watch = _Watch(self)
        while True:
            try:
                return pending.get(timeout=POLL_S)
            except mp.TimeoutError:
                watch.check()

    def imap_unordered(self, fn: Callable, tasks: Iterable, code: Callable[[Any], tuple[int, str]]) -> Iterator:
        """fn's results in completion order; code(task): its board code and what it reads."""
        def named():
            for task in tasks:  # in the pool's task thread, as the workers take them
                k, what = code(task)
                self.names[k] = what
                yield task

        it = self.pool.imap_unordered(fn, named(), chunksize=1)
        watch = _Watch(self)
        while True:
            try:
                r = it.next(timeout=POLL_S)
            except StopIteration:
                return
            except mp.TimeoutError:
                watch.check()
                continue
            watch.result()
            yield r

    def busy(self) -> dict[int, int]:
        """pid -> the code of what it is doing, for the workers not idle."""
        b = self.board[:]
        return {b[1 + 2 * k]: b[2 + 2 * k] for k in range(len(self.procs)) if b[2 + 2 * k]}

    def describe(self, code: int) -> str:
        what = self.names.get(code, "")
        if code == SNIFF:
            return "sniffing the input files"
        kind = f"unit {code - 1}" if code > 0 else f"the SHA-256 of input {-code - 1}"
        return f"{kind} ({what})" if what else kind


class _Watch:
    """The checks between two waits (see the Note)."""

    def __init__(self, w: Workers):
        self.w = w
        self.last = time.monotonic()  # the last result, or the start
        self.seen: dict[tuple[int, int], float] = {}  # (pid, code) -> when first seen
        self.told: dict[tuple[int, int], int] = {}
        self.cpu: dict[tuple[int, int], tuple[float, float]] = {}  # (pid, code) -> (CPU s, since when)

    def result(self) -> None:
        self.last = time.monotonic()

    def check(self) -> None:
        now, busy = time.monotonic(), self.w.busy()
        for p in self.w.procs:
            if p.exitcode is not None:
                task = busy.get(p.pid)
                raise DataError(f"worker {p.pid} {_ended(p.exitcode)} while "
                                f"{self.w.describe(task) if task else 'idle'}; the prepare stopped")
        if not busy and now - self.last > LOST_S:
            raise DataError(f"no worker result for {LOST_S:.0f} s and every worker idle: a task was lost "
                            "(a bug: please report this line); the prepare stopped, run it again")
        for key in list(self.seen):
            if busy.get(key[0]) != key[1]:
                del self.seen[key]
                self.cpu.pop(key, None)
        self._stuck(busy, now)
        for pid, code in busy.items():
            since = self.seen.setdefault((pid, code), now)
            n = self.told.get((pid, code), 0)
            if now - since > SLOW_S * (n + 1):
                self.told[pid, code] = n + 1
                print(f"prepare: worker {pid} has been on {self.w.describe(code)} for {now - since:.0f} s",
                      file=sys.stderr, flush=True)

    def _stuck(self, busy: dict[int, int], now: float) -> None:
        for pid, code in busy.items():
            cpu = _cpu_seconds(pid)
            if cpu is None:
                continue
            last, since = self.cpu.get((pid, code), (-1.0, now))
            if cpu != last:
                self.cpu[pid, code] = (cpu, now)
            elif now - since > STUCK_S:
                _print_stack(pid)
                raise DataError(f"worker {pid} has used no CPU for {now - since:.0f} s on {self.w.describe(code)}: "
                                "stuck, not slow (its stack is printed above; please report it); the prepare "
                                "stopped, run it again")


def _cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU time (Linux), None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
