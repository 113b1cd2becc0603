"""Preemption: a signal becomes one complete checkpoint and a distinct exit code (docs/preemption.md).

Worker side (`PreemptionGuard`, used by the training loop at each step boundary):
  SIGTERM or SIGUSR1 only sets a flag (the handler does no I/O and no collective). At the next
  step boundary every rank contributes its flag to one tiny all-reduce (MAX), so all ranks
  decide together and no rank saves a step the others did not take. Then the normal atomic,
  synchronous CheckpointManager save of the current step, `preempted.json` in the run
  directory (step, signal, seconds the save took), and exit code PREEMPTED_EXIT_CODE.
  A second signal changes nothing: the save under way finishes. A SIGKILL (the grace period
  ran out) at any moment leaves either the new checkpoint or none, never a torn one: the
  save writes step_N.tmp and renames it only when complete, so the previous one stays loadable.

Agent side (`shardlab train --nproc N`, and `python -m shardlab.torchrun` in rendered jobs):
  torchrun's elastic agent forwards the signals it handles to its workers and waits up to its
  shutdown timeout before SIGKILL. We add SIGUSR1 to those signals and set the timeout to the
  grace period; the agent then exits PREEMPTED_EXIT_CODE when its workers saved (a marker
  file written by local rank 0 after the save says so), else as before.

[Note: why 75] The agent counts any non-zero worker exit as a failure: with --max-restarts
left it restarts the group. When the *agent* is signalled it shuts down instead (no restart),
whatever the workers' codes; a worker signalled alone under an agent with restarts left is
restarted and resumes from the preemption checkpoint, which costs one restart, not a loop.
75 is EX_TEMPFAIL of sysexits.h ("temporary failure, retry later"), used by no other path of
shardlab (0 done, 1 error, 2 bad config, 128+N killed by signal N), so a batch script or a
podFailurePolicy can tell "saved, resume me" from a crash.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardlab.config import Config

PREEMPTED_EXIT_CODE = 75
PREEMPTED_FILE = "preempted.json"
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# torchrun's own default list plus SIGUSR1 (what `#SBATCH --signal` sends)
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# the agent tells its workers where to leave the "saved" marker (local rank 0 writes it)
MARKER_ENV = "SHARDLAB_PREEMPTION_MARKER"


class Preempted(Exception):
    """Raised out of the training loop after the preemption checkpoint is complete."""

    def __init__(self, record: dict[str, Any]):
        self.record = record
        super().__init__(f"preempted by {record['signal']} at step {record['step']}: checkpoint "
                         f"{record['checkpoint']} saved in {record['save_seconds']:.2f} s")


# ------------------------------------------------------------------------------------------- worker
class PreemptionGuard:
    """Catches the preemption signals in this worker while it is active (a context manager:
    the previous handlers come back on exit, so tests can train several runs in one process)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.signum: int | None = None          # the first signal received
        self.received_at: float | None = None   # its wall-clock time
        self.count = 0                          # signals received (a second one only logs)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionGuard:
        if not self.enabled:
            return self
        _clear_marker()
        if threading.current_thread() is not threading.main_thread():
            # signal.signal works only in the main thread; say so instead of failing the run
            print("shardlab: not the main thread: preemption signals are not caught here", flush=True)
            self.enabled = False
            return self
        for sig in HANDLED_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        # Only flags: the step in progress (possibly inside a collective, or a save) must finish.
        self.count += 1
        if self.signum is None:
            self.signum, self.received_at = signum, time.time()

    def should_stop(self, rt: Any) -> bool:
        """Every rank calls this at the same step boundary: one all-reduce (MAX) of the signal
        number received so far (0 = none), so all ranks stop at the same step or none does."""
        if not self.enabled:
            return False
        import torch
        import torch.distributed as dist

        from shardlab.engines import collectives

        flag = torch.tensor([self.signum or 0], dtype=torch.int32, device=rt.device)
        if rt.distributed and rt.world_size > 1:
            collectives.all_reduce(flag, op=dist.ReduceOp.MAX)  # in the hang doctor's record
        agreed = int(flag.item())
        if agreed and self.signum is None:  # another rank got it: report its signal
            self.signum = agreed
        return agreed != 0

    def save_and_record(self, run: Any) -> dict[str, Any]:
        """The preemption checkpoint of the current step (every rank calls), then preempted.json
        (rank 0) and the agent's marker (local rank 0). Returns the record."""
        state, rt = run.state, run.rt
        t0 = time.perf_counter()
        path = run.save_now()
        save_seconds = time.perf_counter() - t0
        record = {
            "step": state.step,
            "signal": signal.Signals(self.signum).name if self.signum else None,
            "save_seconds": save_seconds,
            "checkpoint": path,
            "signals_received_here": self.count,
            "signal_to_exit_s": (time.time() - self.received_at) if self.received_at else None,
            "exit_code": PREEMPTED_EXIT_CODE,
            "world_size": rt.world_size,
            "restart_count": rt.restart_count,
            "unix_time": time.time(),
        }
        if rt.is_main:
            from shardlab.atomic import write_json_atomic

            os.makedirs(run.out_dir, exist_ok=True)
            write_json_atomic(os.path.join(run.out_dir, PREEMPTED_FILE), record)
        _write_marker(record)
        return record


def _marker_path() -> str | None:
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    return os.environ.get(MARKER_ENV) or None


def _clear_marker() -> None:
    """A fresh worker group has saved nothing yet (a restarted one must not inherit the mark)."""
    path = _marker_path()
    if path and os.path.exists(path):
        os.remove(path)


def _write_marker(record: dict[str, Any]) -> None:
    path = _marker_path()
    if path:
        with open(path, "w") as f:
            json.dump(record, f)


# -------------------------------------------------------------------------------------------- agent
def new_marker(directory: str | None = None) -> str:
    """A path for this agent's marker (set MARKER_ENV to it before the workers start)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="shardlab-preempted-", dir=directory)
    os.close(fd)
    os.remove(path)
    return path


def read_marker(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def agent_exit_code(exc: BaseException | None, marker: str) -> int:
    """What an agent process exits with after elastic_launch returned or raised `exc`:
    PREEMPTED_EXIT_CODE when its workers saved a preemption checkpoint, else 0 / 128+signal / 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    saved = read_marker(marker) is not None
    if exc is None:
        return 0
    if isinstance(exc, SignalException):
        return PREEMPTED_EXIT_CODE if saved else 128 + int(exc.sigval)
    if isinstance(exc, ChildFailedError) and saved and all(
            f.exitcode == PREEMPTED_EXIT_CODE for f in exc.failures.values()):
        return PREEMPTED_EXIT_CODE
    return 1


def raise_in_agent(signum: int, frame: Any) -> None:
    """Before the agent installs its handlers: the same reaction as its own (SignalException)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum).name}",
                          sigval=signal.Signals(signum))


# ------------------------------------------------------------------------- how long a save takes
@dataclass
class GraceEstimate:
    """Seconds from the signal to the workers' exit, and where the save time came from."""

    grace_s: int
    save_s: float
    source: str          # "config" | "measured (<path>)" | "estimated (...)"

    def describe(self) -> str:
        return f"preemption grace {self.grace_s} s (save {self.save_s:.1f} s, {self.source})"


def measured_save_seconds(cfg: Config) -> tuple[float, str] | None:
    """The newest complete checkpoint's recorded save time, if the config's checkpoint
    directory already holds one (a previous run or attempt of the same job)."""
    from shardlab.checkpoint import list_checkpoints, read_manifest

    root = cfg.checkpoint.dir
    if root is None and cfg.output.run_name:
        root = os.path.join(cfg.output.dir, cfg.output.run_name, "checkpoints")
    if root is None or not os.path.isdir(root):
        return None
    for _, path in reversed(list_checkpoints(root)):
        try:
            seconds = read_manifest(path).get("save_seconds")
        except Exception:  # noqa: BLE001 - an unreadable manifest just is no measurement
            continue
        if seconds:
            return float(seconds), path
    return None


def state_bytes(cfg: Config) -> int:
    """fp32 parameters plus optimizer state, as a checkpoint holds them (shapes on the meta device)."""
    from shardlab.models import MODELS, build_model, count_parameters

    vocab = None
    if MODELS[cfg.model.name].data_kind == "tokens":
        vocab = 256
        if cfg.data.tokenizer:
            with open(os.path.join(cfg.data.tokenizer, "tokenizer.json")) as f:
                vocab = max(256, len(json.load(f).get("model", {}).get("vocab", {})))
    n = count_parameters(build_model(cfg.model, seed=cfg.seed, vocab_size=vocab, device="meta"))
    per_param = 4 + (8 if cfg.train.optimizer == "adamw" else 4 if cfg.train.momentum else 0)
    return n * per_param


def grace_estimate(cfg: Config) -> GraceEstimate:
    """preemption.grace_s if set, else ceil(2 x save + preemption.margin_s), where the save time is
    preemption.save_s, else measured (the newest checkpoint's manifest), else estimated from the
    model's state bytes at preemption.write_mb_s. Twice the save: a preempted fleet saves at
    once and shared storage slows down; the margin covers the step in flight and process exit."""
    p = cfg.preemption
    if p.save_s is not None:
        save, source = p.save_s, "preemption.save_s"
    else:
        measured = measured_save_seconds(cfg)
        if measured is not None:
            save, source = measured[0], f"measured: {measured[1]}"
        else:
            nbytes = state_bytes(cfg)
            save = nbytes / (p.write_mb_s * 2**20)
            source = (f"estimated: {nbytes / 2**20:.1f} MiB of parameters and optimizer state at "
                      f"preemption.write_mb_s={p.write_mb_s:g}")
    if p.grace_s is not None:
        return GraceEstimate(int(math.ceil(p.grace_s)), save, source + "; preemption.grace_s set")
    return GraceEstimate(int(math.ceil(2 * save + p.margin_s)), save, source)
