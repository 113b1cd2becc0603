"""The hang doctor (shardlab.doctor, docs/debugging.md).

- the flight file: ring, sequence numbers per group, reader; and the diagnosis of hand-made
  records of 2-3 ranks (desync, crashed, frozen, straggler, data and checkpoint stall, the
  launcher's own kills not blamed): no processes, a second;
- one 2-rank spawn: every engine records its collectives, the same sequence on both ranks,
  labelled with units and phases, and a finished run reads as finished;
- the real launcher, end to end (module fixture `launches`): one rank SIGSTOPped under fsdp
  (2 ranks) and under torch-fsdp (3 ranks) (with `shardlab doctor --live` during the hang and
  `shardlab doctor` after it), and, while those wait out their timeout, a rank that raises
  (zero3), a data stall (torch-ddp) and a planted desync through a raw torch.distributed
  all-reduce (fsdp), one after the other. Faults are planted by tests/doctor_faults.py through a
  generated sitecustomize.py. Each ends in a few lines on the terminal, the verdict first; the
  workers' tracebacks are in files.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardlab.doctor import analysis, flight, report
from shardlab.doctor.flight import RECORDER, FlightRecorder, flight_path
from shardlab.doctor.flight_read import read_flight
from shardlab.testing import run_workers
from tests.doctor_faults import PLANTED_BYTES, SITECUSTOMIZE

ROOT = Path(__file__).resolve().parents[1]
# a hang guard only (pytest-timeout; the suite's is 300 s a test, setup included): the first test of
# `launches` carries its five runs, 77 s idle, 160-185 s beside two CPU hogs, more at load 10
pytestmark = pytest.mark.timeout(1800)


# ------------------------------------------------------------------------ hand-made flight records
class FakeRank:
    """One rank's files under debug/, written through the real FlightRecorder."""

    def __init__(self, debug: Path, rank: int, world: int, groups: dict[str, list[int]], units=("blocks.0",)):
        self.rec = FlightRecorder()
        self.rec.describe_group = lambda g: (g, groups[g])
        self.rec.open(flight_path(str(debug), rank), rank=rank, world=world, attempt=0, capacity=64)
        self.debug, self.rank, self.world, self.units = debug, rank, world, list(units)

    def step(self, step: int, phase: str) -> FakeRank:
        self.rec.set_step(step)
        self.rec.enter_phase(phase)
        return self

    def coll(self, kind: str, nbytes: int = 1024, group: str = "0", done: bool = True, unit: int = 0) -> FakeRank:
        self.rec.set_unit(unit)
        n = self.rec.issue(kind, nbytes, group)
        if done:
            self.rec.complete(n)
        return self

    def close(self, exit: dict | None = None, tick_age: float = 0.0, state: str | None = None) -> None:
        self.rec.tick(0)
        if tick_age:  # the watcher last ran tick_age seconds ago (a stopped process)
            flight._WATCH.pack_into(self.rec.mm, flight._WATCH_AT, time.time() - tick_age, 0)
        if state:
            self.rec.set_state(state)
        groups = [{"name": n, "ranks": r} for n, r in self.rec.group_names]
        meta = {"rank": self.rank, "world": self.world, "pid": 100 + self.rank, "host": "h", "launch": "L",
                "attempt": 0, "started": time.time(), "strategy": "fsdp", "timeout_s": 5.0, "groups": groups,
                "units": self.units}
        (self.debug / f"rank{self.rank}.meta.json").write_text(json.dumps(meta))
        if exit is not None:
            (self.debug / f"rank{self.rank}.exit.json").write_text(json.dumps({"time": time.time(), **exit}))
        self.rec.close()


def _ranks(tmp_path: Path, world: int = 2) -> tuple[Path, list[FakeRank]]:
    debug = tmp_path / "debug"
    debug.mkdir(parents=True)
    groups = {"0": list(range(world))}
    return tmp_path, [FakeRank(debug, r, world, groups) for r in range(world)]


def _timed_out() -> dict:
    return {"exception": "RuntimeError", "message": "RuntimeError: Timed out waiting 5000ms for recv operation",
            "peer_failure": True, "traceback": ""}


def test_flight_file_ring_and_sequence_numbers(tmp_path):
    rec = FlightRecorder()
    rec.describe_group = lambda g: ({None: "0", "sub": "7"}[g], [0, 1] if g is None else [1])
    rec.open(str(tmp_path / "r.flight"), rank=1, world=2, attempt=2, capacity=16)
    rec.set_step(4)
    rec.enter_phase("backward")
    for i in range(20):
        n = rec.issue("reduce_scatter" if i % 2 else "all_gather", 100 + i, None if i % 4 else "sub")
        if i < 19:
            rec.complete(n)
    rec.tick(7)
    f = read_flight(str(tmp_path / "r.flight"))
    assert (f.rank, f.world, f.attempt, f.step, f.phase, f.issued, f.answered, f.state) == \
        (1, 2, 2, 4, "backward", 20, 7, "running")
    assert [e.number for e in f.entries] == list(range(5, 21))       # the ring keeps the last 16
    assert rec.group_names == [("7", [1]), ("0", [0, 1])]              # ids in order of first use
    world = [e for e in f.entries if e.group == 1]
    assert [e.seq for e in world] == list(range(4, 16))               # numbered per group, across the wrap
    assert [e.seq for e in f.entries if e.group == 0] == [2, 3, 4, 5]
    assert f.entries[-1].kind == "reduce_scatter" and not f.entries[-1].done and f.entries[-2].done
    assert {e.phase for e in f.entries} == {"backward"} and {e.step for e in f.entries} == {4}
    rec.close("finished")
    assert read_flight(str(tmp_path / "r.flight")).state == "finished"


def test_diagnosis_of_hand_made_records(tmp_path):
    # frozen: rank 1 stopped in forward of step 3 after gather #2; rank 0 timed out in gather #3
    run, (r0, r1) = _ranks(tmp_path / "frozen")
    r0.step(3, "forward").coll("all_gather").coll("all_gather").coll("all_gather", done=False)
    r1.step(3, "forward").coll("all_gather").coll("all_gather")
    r1.close(tick_age=10)
    r0.close(exit=_timed_out())
    d = analysis.diagnose(str(run))
    assert d.kind == "frozen" and [f.rank for f in d.findings] == [1]
    line = report.verdict(d)
    assert line.startswith("rank 1 is stuck (frozen") and "step 3, phase forward" in line
    assert "rank 0 waited for it in all_gather #3" in line
    # frozen after its step's last reduce-scatter, before the optimizer's gradient-norm all-reduce
    # (CI's window): rank 0 waits in that all-reduce, which rank 1 never issued
    run, (r0, r1) = _ranks(tmp_path / "frozen-before-norm")
    r0.step(3, "backward").coll("reduce_scatter").step(3, "optimizer").coll("all_reduce", 4, done=False)
    r1.step(3, "backward").coll("reduce_scatter")
    r1.close(tick_age=10)
    r0.close(exit=_timed_out())
    line = report.verdict(analysis.diagnose(str(run)))
    assert line.startswith("rank 1 is stuck (frozen") and "step 3, phase backward" in line
    assert "rank 0 waited for it in all_reduce #2" in line and "optimizer, step 3, 4 B" in line, line
    # the same, but rank 1's process still ran: a straggler; in phase data: a data stall
    for phase, kind in (("optimizer", "straggler"), ("data", "data stall"), ("checkpoint", "checkpoint stall")):
        run, (r0, r1) = _ranks(tmp_path / kind.replace(" ", "-"))
        r0.step(5, "forward").coll("all_reduce").coll("all_reduce", done=False)
        r1.step(5, phase).coll("all_reduce")
        r1.close()
        r0.close(exit=_timed_out())
        d = analysis.diagnose(str(run))
        assert d.kind == kind and report.verdict(d).startswith(f"rank 1 is stuck ({kind}")
    # desync: rank 2 issued an extra all-reduce as #2 of the world group
    run, (r0, r1, r2) = _ranks(tmp_path / "desync", world=3)
    for r in (r0, r1):
        r.step(2, "forward").coll("all_gather", 3072).coll("all_gather", 3072, done=False)
    r2.step(2, "forward").coll("all_gather", 3072).coll("all_reduce", 4, done=False)
    for r in (r0, r1, r2):
        r.close()
    d = analysis.diagnose(str(run), live=True, now=time.time() + 30)
    assert d.kind == "desync" and d.desync["seq"] == 2
    assert {r: e.kind for r, e in d.desync["entries"].items()} == {0: "all_gather", 1: "all_gather", 2: "all_reduce"}
    assert "desync at collective #2 of group 0 [0, 1, 2]" in report.verdict(d)


def test_crashes_and_the_launchers_own_kills(tmp_path):
    # rank 1 raised; rank 0, waiting, was then stopped by the launcher (SIGTERM): only rank 1 is blamed
    run, (r0, r1) = _ranks(tmp_path / "raised")
    r0.step(3, "backward").coll("reduce_scatter", done=False)
    r1.step(3, "loop")
    r1.close(exit={"exception": "ValueError", "message": "ValueError: boom", "peer_failure": False,
                   "traceback": 'File "/x/src/shardlab/loop/train.py", line 9, in train_step\n'})
    r0.close()
    (run / "debug" / "exits.json").write_text(json.dumps({"launch": "L", "ranks": {
        "1": {"exitcode": 1, "timestamp": 100}, "0": {"exitcode": -15, "timestamp": 100}}}))
    d = analysis.diagnose(str(run))
    assert d.kind == "crashed" and [f.rank for f in d.findings] == [1]
    assert report.verdict(d).startswith("rank 1 crashed (exit code 1) at step 3, phase loop: ValueError: boom")
    text = report.format_report(d)
    assert "killed by SIGTERM from the launcher" in text and not re.search(r"rank 0 (crashed|is stuck)", text)
    # rank 1 killed by SIGKILL first (out of memory): crashed; rank 0's later SIGKILL is the launcher's
    run, (r0, r1) = _ranks(tmp_path / "killed")
    r0.step(2, "forward").coll("all_gather", done=False)
    r1.step(2, "forward")
    r0.close(tick_age=1)
    r1.close(tick_age=6)
    (run / "debug" / "exits.json").write_text(json.dumps({"launch": "L", "ranks": {
        "1": {"exitcode": -9, "timestamp": 100}, "0": {"exitcode": -9, "timestamp": 131}}}))
    d = analysis.diagnose(str(run))
    assert [(f.rank, f.kind) for f in d.findings] == [(1, "crashed")]
    assert report.verdict(d).startswith("rank 1 crashed at step 2, phase forward: killed by SIGKILL")
    # a fatal signal's stacks (faulthandler.enable in the worker) are shown with the rank
    (run / "debug" / "rank1.fatal.txt").write_text(
        'Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f2 (most recent call first):\n'
        '  File "/x/src/shardlab/engines/fsdp.py", line 5 in boom\n')
    assert "fatal signal: Fatal Python error: Segmentation fault <- shardlab/engines/fsdp.py:5 in boom" in \
        report.format_report(analysis.diagnose(str(run)))
    # every rank finished
    run, (r0, r1) = _ranks(tmp_path / "done")
    for r in (r0, r1):
        r.step(4, "finish").coll("all_reduce")
        r.close(state="finished")
    assert analysis.diagnose(str(run)).kind == "finished"


def test_what_the_launcher_prints_after_a_failure(tmp_path):
    """doctor/agent.py's failure_lines: the verdict first, the exception that matters (the culprit's
    own, with where it was raised), where the rest is; resume advice only when a worker was lost."""
    from types import SimpleNamespace

    from shardlab.doctor.agent import failure_lines

    def failure(code: int, message: str = "", t: int = 100) -> SimpleNamespace:
        return SimpleNamespace(exitcode=code, timestamp=t, local_rank=0, message=message)

    # rank 1 raised (an exception of the code): no advice, a restart would raise it again
    run, (r0, r1) = _ranks(tmp_path / "raised")
    r0.step(3, "backward").coll("reduce_scatter", done=False)
    r1.step(3, "loop")
    r1.close(exit={"exception": "ValueError", "message": "ValueError: boom", "peer_failure": False,
                   "traceback": 'File "/x/src/shardlab/loop/train.py", line 9, in train_step\n'})
    r0.close(exit=_timed_out())
    lines = failure_lines(str(run), analysis.diagnose(str(run)), {1: failure(1)}, "/logs")
    assert lines[0].startswith("error: rank 1 crashed") and lines[1] == "error: rank 1: ValueError: boom, at " \
        "shardlab/loop/train.py:9 in train_step", lines
    assert "/logs/<rank>/stderr.log" in lines[2] and f"shardlab doctor {run}" in lines[2] and len(lines) == 3
    # rank 1 frozen: rank 0's timeout is the exception shown, and the advice comes (a worker was lost)
    run, (r0, r1) = _ranks(tmp_path / "frozen")
    r0.step(3, "forward").coll("all_gather").coll("all_gather", done=False)
    r1.step(3, "forward").coll("all_gather")
    r1.close(tick_age=10)
    r0.close(exit=_timed_out())
    lines = failure_lines(str(run), analysis.diagnose(str(run)), {0: failure(1), 1: failure(-9, t=131)}, None)
    assert lines[0].startswith("error: rank 1 is stuck (frozen") and lines[1].startswith("error: rank 0: RuntimeError")
    assert "a worker was lost" in lines[-1] and len(lines) == 4
    # without the doctor: torch's error files; the exception that is not a lost peer is the one shown
    lines = failure_lines(str(run), None, {0: failure(1, "RuntimeError: Connection closed by peer"),
                                           1: failure(1, "ValueError: planted", t=101)}, None)
    assert lines[:2] == ["error: the run failed: rank 0 exit code 1, rank 1 exit code 1", "error: rank 1: ValueError: "
                         "planted"] and "a worker was lost" not in lines[-1]
    # a checkpoint refused by every rank: its own words, once
    run, (r0, r1) = _ranks(tmp_path / "refused")
    for r in (r0, r1):
        r.close(exit={"exception": "CheckpointError", "message": "shardlab.errors.CheckpointError: checkpoint x is "
                      "corrupt", "peer_failure": False, "traceback": ""})
    assert failure_lines(str(run), analysis.diagnose(str(run)), {0: failure(1), 1: failure(1)}, None)[0] == \
        "error: checkpoint x is corrupt"


# -------------------------------------------------------------------- every engine, in one spawn
ENGINE_KINDS = {"ddp": {"all_reduce"}, "zero3": {"broadcast", "reduce"}, "fsdp": {"all_gather", "reduce_scatter"},
                "torch-ddp": {"all_reduce"}, "torch-fsdp": {"all_gather", "reduce_scatter"}}


def _train_every_engine(rank: int, world: int, out: str) -> dict:
    from shardlab.loop import train as T
    from tests.checkpoint_helpers import make_cfg, runtime

    seen = {}
    for strategy in ENGINE_KINDS:
        cfg = make_cfg(strategy, out, strategy, "checkpoint.every_steps=0", "train.eval_batches=1", steps=2, every=0)
        result = T.train(cfg, runtime(rank, world, strategy))
        f = read_flight(flight_path(os.path.join(out, strategy, "debug"), rank))
        seen[strategy] = {"state": f.state, "steps": sorted({e.step for e in f.entries}),
                          "trained": [(e.seq, e.kind, e.nbytes, e.phase, e.unit) for e in f.entries if e.step > 0],
                          "counted": {k: v["calls"] for k, v in result["comm_bytes"][rank].items()}}
    seen["raw"] = _raw_calls(rank, world, os.path.join(out, "raw"))
    return seen


def _raw_calls(rank: int, world: int, out: str) -> dict:
    """torch.distributed called directly while the doctor is on: each call entered once (ours,
    through collectives, not twice), async ones completed at wait(); the originals back after."""
    import torch
    import torch.distributed as dist

    from shardlab.doctor import worker
    from shardlab.engines import collectives

    original = dist.all_reduce
    worker.start(out, rank, world)
    dist.all_reduce(torch.ones(3))
    collectives.all_reduce(torch.ones(2))
    gathered = torch.empty(2 * world)
    dist.all_gather_into_tensor(gathered, torch.ones(2), async_op=True).wait()
    dist.barrier()
    worker.finish()
    f = read_flight(flight_path(os.path.join(out, "debug"), rank))
    return {"entries": [(e.kind, e.nbytes, e.done) for e in f.entries], "restored": dist.all_reduce is original}


@pytest.mark.slow
def test_every_engine_records_its_collectives(tmp_path):
    t0 = time.monotonic()
    ranks = run_workers(2, _train_every_engine, str(tmp_path), timeout_s=240)
    print(f"\n2-rank spawn, five engines x 2 steps: {time.monotonic() - t0:.1f} s")
    assert RECORDER.mm is None  # nothing of a worker's recorder leaked into this process
    for strategy, kinds in ENGINE_KINDS.items():
        a, b = ranks[0][strategy], ranks[1][strategy]
        assert a["state"] == b["state"] == "finished"
        assert a["steps"] == b["steps"] and {1, 2} <= set(a["steps"])
        trained = a["trained"]
        assert [(s, k, n) for s, k, n, _, _ in trained] == [(s, k, n) for s, k, n, _, _ in b["trained"]], strategy
        assert {k for _, k, _, phase, _ in trained if phase in ("forward", "backward")} == kinds, strategy
        assert {phase for _, _, _, phase, _ in trained} >= {"backward"}
        assert any(unit >= 0 for *_, unit in trained), f"{strategy}: no collective labelled with a unit"
        # each engine collective entered once: shardlab's own are not recorded again by the raw wrapper
        # (engines/raw_collectives.py) though torch's DDP and FSDP2 issue them through torch.distributed
        for kind in kinds:
            entered = sum(1 for _, k, _, phase, _ in trained if k == kind and phase in ("forward", "backward"))
            assert entered == a["counted"][kind], (strategy, kind, entered, a["counted"])
        if strategy in ("zero3", "fsdp", "torch-fsdp"):  # the gradient norm of shards: one fp32 all-reduce,
            # recorded, so a rank that waits in it is seen waiting (CI once stopped rank 1 just before it)
            assert ("all_reduce", 4, "optimizer") in {(k, n, phase) for _, k, n, phase, _ in trained}, strategy
        d = analysis.diagnose(str(tmp_path / strategy))
        assert d.kind == "finished", report.format_report(d)
    for r in ranks:
        assert r["raw"]["entries"] == [("all_reduce", 12, True), ("all_reduce", 8, True), ("all_gather", 16, True),
                                       ("barrier", 0, True)]
        assert r["raw"]["restored"]


# ------------------------------------------------------------------- the real launcher, end to end
# [Note: the launches' timeouts on a busy machine]
# parallel.timeout_s is also the workers' rendezvous and the first step's wait for rank 0 (which
# measures the matmul peak when the cache misses: 5 s on loaded cores), so it is sized for a loaded
# machine (CI: load 9-12 on 2 cores), not for an idle one. At 15 s, beside two CPU hogs, the live view
# came 29 s into the SIGSTOP run's hang, after rank 0 had given up: a fresh `shardlab doctor` spent
# most of that importing torch, and the 2-rank run was stopped first and waited for the 3-rank run to
# reach its step. Now the live view's interpreter has imported shardlab before the stop
# (`_primed_doctor`) and each run is stopped at its own step 3: 10-12 s into the hang at load 8-10,
# against 60 s. The 60 s cost 20-40 s of the module's time idle (the three fault runs, one after
# the other in the SIGSTOP runs' shadow, take 80-100 s; the SIGSTOP runs 110-120 s: the launcher
# also waits out its SIGTERM grace for the stopped rank).
STOP_TIMEOUT_S = 60      # the SIGSTOP runs: the hang `shardlab doctor --live` looks at (see the Note)
FAULT_TIMEOUT_S = 20     # the data stall and the desync end at it (see the Note; 8 s held at load 9-12)
HANG_GUARD_S = 600       # a hang guard only: no launch or doctor run here takes a minute on an idle machine


class Launch:
    """`shardlab train --nproc 2` of gpt-nano in the background, with a planted fault."""

    def __init__(self, root: Path, name: str, strategy: str, timeout_s: float, fault: str | None = None,
                 model: str = "gpt", nproc: int = 2):
        self.run_dir = root / name
        self.log = root / f"{name}.log"
        self.nproc = nproc
        cmd = [sys.executable, "-m", "shardlab", "train", "--nproc", str(nproc), f"parallel.strategy={strategy}",
               f"model.name={model}", "model.preset=gpt-nano", "data.source=synthetic", "data.seq_len=32",
               "data.synthetic_samples=256", "train.steps=200", f"train.global_batch_size={4 * nproc}",
               "train.micro_batch_size=2", "train.eval_batches=1", f"output.dir={root}", f"output.run_name={name}",
               "output.progress=false", "output.tensorboard=false", "preemption.enabled=false",
               f"parallel.timeout_s={timeout_s}"]
        # this checkout's shardlab (src/) whatever is installed; the repository root for tests.doctor_faults
        path = os.pathsep.join(map(str, (root / "site", ROOT / "src", ROOT)))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        if fault:
            env["SHARDLAB_TEST_FAULT"] = fault
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)
        # when the launcher exited, taken as it happens: wait() may come long after (the SIGSTOP runs
        # are waited for once the fault runs are done)
        self.exited_at: float | None = None
        self.killed = False
        self._exited = threading.Event()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.proc.wait()
        self.exited_at = time.monotonic()
        self._exited.set()

    @property
    def running(self) -> bool:
        """(not proc.poll(), which answers None while the reaping thread waits on the process)"""
        return not self._exited.is_set()

    def flight(self, rank: int):
        return read_flight(flight_path(str(self.run_dir / "debug"), rank))

    def wait_for_step(self, rank: int, step: int):
        """The rank's heartbeat at `step` or later; fails at once if the run ends first."""
        deadline = time.monotonic() + HANG_GUARD_S
        while self.running:
            try:
                f = self.flight(rank)
                if f.step >= step:
                    return f
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"hang guard: {self.run_dir.name}: rank {rank} not at step {step} after "
                                     f"{HANG_GUARD_S} s: {self.text()[-3000:]}")
            time.sleep(0.02)
        raise AssertionError(f"{self.run_dir.name}: ended before rank {rank} reached step {step}: {self.text()[-3000:]}")

    def wait(self) -> int:
        """The launcher's exit status; killed (and failed) after HANG_GUARD_S, a hang guard."""
        if not self._exited.wait(timeout=HANG_GUARD_S):
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self._exited.wait()
        self.seconds = self.exited_at - self.t0
        assert not self.killed, f"hang guard: {self.run_dir.name} still running after {HANG_GUARD_S} s: killed"
        return self.proc.returncode

    def text(self) -> str:
        return self.log.read_text()


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlab", "doctor", *args], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


# `shardlab doctor ARGS` once a line comes on stdin, in an interpreter that has imported it already
# ("ready" on stdout): importing torch is most of a fresh doctor's time, and on a loaded machine it
# was tens of seconds of the hang
PRIMED = ("import sys\nfrom shardlab.cli import main\nfrom shardlab.doctor import analysis, report, worker\n"
          "print('ready', flush=True)\nsys.stdin.readline()\nsys.exit(main(['doctor', *sys.argv[1:]]))\n")


def _primed_doctor(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRIMED, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _stop(launch: Launch) -> dict:
    """SIGSTOP rank 1 once it is in step 3; what its heartbeat says then (it cannot change after)."""
    pid = launch.wait_for_step(1, 3).pid
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    f = launch.flight(1)
    return {"pid": pid, "at": stopped, "step": f.step, "phase": f.phase}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor-launches")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    t0 = time.monotonic()
    runs = {"stop-fsdp": Launch(root, "stop-fsdp", "fsdp", STOP_TIMEOUT_S),
            "stop-torch-fsdp": Launch(root, "stop-torch-fsdp", "torch-fsdp", STOP_TIMEOUT_S, nproc=3)}
    stops, live = {}, None
    primed = _primed_doctor(str(runs["stop-fsdp"].run_dir), "--live", "--wait", "2")
    # each run's rank 1 stopped as soon as it is in step 3, side by side: one after the other, the
    # 2-rank run's hang went on while the 3-rank run (slower to start) got there, 10 s at load 9
    stopping = concurrent.futures.ThreadPoolExecutor(len(runs))
    pending = {name: stopping.submit(_stop, launch) for name, launch in runs.items()}
    try:
        stops["stop-fsdp"] = pending["stop-fsdp"].result()
        # the hang, seen live: once rank 1's heartbeat is clearly stale, before rank 0's timeout
        a = runs["stop-fsdp"]
        assert primed.stdout.readline() == "ready\n", primed.communicate()
        while time.time() - a.flight(1).tick < analysis.NOT_RUNNING_AFTER_S + 0.5:
            time.sleep(0.1)
        out, err = primed.communicate("go\n", timeout=HANG_GUARD_S)
        live = subprocess.CompletedProcess(primed.args, primed.returncode, out, err)
        live.seconds_into_hang = time.monotonic() - stops["stop-fsdp"]["at"]
        live.run_still_running = a.running
        (root / "live.txt").write_text(live.stdout + live.stderr)
        stops["stop-torch-fsdp"] = pending["stop-torch-fsdp"].result()
        # while those wait out their timeouts (idle), the other faults one after the other
        for name, strategy, fault, model in (("raise", "zero3", "raise:1:3", "gpt"),
                                             ("data-stall", "torch-ddp", "data-stall:1:3", "gpt"),
                                             ("desync", "fsdp", "desync:1:5", "gpt-desync")):
            runs[name] = Launch(root, name, strategy, FAULT_TIMEOUT_S, fault=fault, model=model)
            runs[name].wait()
        for name in ("stop-fsdp", "stop-torch-fsdp"):
            runs[name].wait()
    finally:
        if primed.poll() is None:
            primed.kill()
            primed.communicate()
        for launch in runs.values():
            if launch.running:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(launch.proc.pid, signal.SIGKILL)
                launch._exited.wait()
        stopping.shutdown()   # each _stop returns or raises once its run has ended
        for f in pending.values():
            if not f.exception():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(f.result()["pid"], signal.SIGCONT)
    print(f"\nfive launches (two SIGSTOPs side by side, three faults in their shadow): "
          f"{time.monotonic() - t0:.1f} s; " + ", ".join(f"{n} {r.seconds:.0f} s" for n, r in runs.items())
          + f"; live view {live.seconds_into_hang:.1f} s into the hang")
    return {"runs": runs, "stops": stops, "live": live}


TERMINAL_LINES = 15   # what a failed launch may print, at most
LOST_ADVICE = "a worker was lost: the same command resumes from the last complete checkpoint"


def _verdict(launch: Launch) -> str:
    """The failure's first line, which must be the doctor's verdict; and the terminal's whole
    output checked: a few lines, no worker traceback (those are in files, one per rank)."""
    lines = launch.text().rstrip().splitlines()
    assert len(lines) <= TERMINAL_LINES, launch.text()
    assert not any(line.startswith("[rank") or "Traceback" in line for line in lines), launch.text()
    logs = list((launch.run_dir / "debug" / "workers").glob("*/attempt_0/*/stderr.log"))
    assert len(logs) == launch.nproc and any("Traceback" in p.read_text() for p in logs)
    assert f"{logs[0].parent.parent}/<rank>/stderr.log" in launch.text()
    return next(line for line in lines if line.startswith("error: "))


def _blames_a_waiting_rank(text: str) -> bool:
    return bool(re.search(r"rank 0 (failed|crashed|is stuck|is missing)|failed first", text))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stop-fsdp", "stop-torch-fsdp"])
def test_sigstopped_rank_is_named_stuck_with_its_step_and_phase(launches, name):
    launch, stop = launches["runs"][name], launches["stops"][name]
    # it ended on its own (Launch.wait's hang guard did not kill it), by rank 0's timeout (below)
    assert launch.proc.returncode not in (0, -signal.SIGKILL), launch.text()[-3000:]
    expected = "rank 1 is stuck (frozen: its process stopped running"
    verdict = _verdict(launch)
    assert verdict.startswith(f"error: {expected}") and f"at step {stop['step']}, phase {stop['phase']}" in verdict
    assert all(f"rank {r} waited for it in " in verdict for r in range(launch.nproc) if r != 1), verdict
    assert not _blames_a_waiting_rank(launch.text()), launch.text()[-3000:]
    # the exception that ended the run (a waiting rank's timeout), and the resume advice: a worker was lost
    # (which waiting rank gives up first, and how gloo says it, depend on timing: any waiting rank,
    # RuntimeError or its subclass DistBackendError, "Timed out waiting ..." or "Application timeout
    # caused pair closure": any error that says it timed out)
    first = re.search(r"^error: rank (\d+)( \(the first to fail\))?: \w*Error: .*(timed out|timeout)", launch.text(),
                      re.M | re.I)
    assert first and first.group(1) != "1", launch.text()
    assert LOST_ADVICE in launch.text()
    # afterwards, from the run directory alone: the same
    after = _doctor(str(launch.run_dir))
    assert after.returncode == 1
    assert after.stdout.rstrip().splitlines()[-1] == verdict.removeprefix("error: ")


@pytest.mark.slow
def test_live_view_shows_the_hang_before_the_timeout(launches):
    live, stop = launches["live"], launches["stops"]["stop-fsdp"]
    # a precondition, not a speed budget: the live view must see the hang, so it has to come before
    # rank 0's timeout ends the run ([Note: the launches' timeouts on a busy machine])
    assert live.run_still_running and live.seconds_into_hang < STOP_TIMEOUT_S, \
        f"the live view came {live.seconds_into_hang:.1f} s into the hang, after the timeout: nothing to show"
    lines = live.stdout.splitlines()
    assert lines[0].split()[:4] == ["rank", "state", "step", "phase"]
    row0, row1 = lines[1].split(), lines[2].split()
    assert row0[:2] == ["0", "running"] and " in " in lines[1]          # rank 0 waits in a collective
    assert row1[:4] == ["1", "not", "running", str(stop["step"])] and row1[4] == stop["phase"]
    assert lines[-1].startswith("rank 1 is stuck (frozen") and live.returncode == 1
    stacks = (launches["runs"]["stop-fsdp"].run_dir / "debug" / "rank0.stacks.txt").read_text()
    assert "shardlab doctor --live" in stacks and "MainThread" in stacks   # rank 0 answered with its stacks


@pytest.mark.slow
def test_rank_that_raises_is_reported_crashed_with_its_exception(launches):
    launch = launches["runs"]["raise"]
    assert launch.proc.returncode == 1
    verdict = _verdict(launch)
    assert verdict.startswith("error: rank 1 crashed (exit code 1) at step 3") and \
        "ValueError: planted failure on rank 1 at step 3" in verdict, verdict
    assert "error: rank 1: ValueError: planted failure on rank 1 at step 3, at " in launch.text()  # where it raised
    assert not _blames_a_waiting_rank(launch.text())
    assert LOST_ADVICE not in launch.text()   # an exception of the code: a restart would raise it again


@pytest.mark.slow
def test_data_stall_is_reported_as_a_data_stall(launches):
    launch = launches["runs"]["data-stall"]
    assert launch.proc.returncode == 1
    verdict = _verdict(launch)
    assert verdict.startswith("error: rank 1 is stuck (data stall: in phase data for") and "at step 3" in verdict
    report_text = _doctor(str(launch.run_dir)).stdout   # the whole report: rank 1's stack, dumped on request
    assert "doctor_faults.py" in report_text and "__getitem__" in report_text, report_text
    assert not _blames_a_waiting_rank(launch.text())


@pytest.mark.slow
def test_planted_desync_is_reported_with_the_first_differing_collective(launches):
    launch = launches["runs"]["desync"]
    assert launch.proc.returncode == 1
    planted = [e for e in launch.flight(1).entries if e.kind == "all_reduce" and e.nbytes == PLANTED_BYTES]
    assert len(planted) == 1
    seq = planted[0].seq
    other = next(e for e in launch.flight(0).entries if e.seq == seq)
    verdict = _verdict(launch)
    assert verdict.startswith(f"error: desync at collective #{seq} of group 0 [0, 1] (the first that differs)")
    # the raw torch.distributed.all_reduce rank 1's model issued is named, beside what rank 0 was in
    assert f"rank 0 issued {other.kind} #{seq}" in verdict and f"rank 1 issued all_reduce #{seq}" in verdict
    assert other.kind == "all_gather"
    assert LOST_ADVICE not in launch.text()   # no worker was lost: a restart would desync again
