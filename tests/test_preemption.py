"""Preemption with real processes: a signal becomes one complete checkpoint of the current step,
preempted.json and exit code 75, and resuming ends bitwise equal to an uninterrupted run.

- the CLI: `shardlab train --nproc 2` gets SIGTERM mid-run (exit 75), the resumed run runs under
  `python -m shardlab.torchrun` and gets SIGUSR1 (exit 75), the third start finishes; losses
  and final parameters and optimizer state equal an uninterrupted run's (the same config, trained
  by spawned workers), bit for bit;
- in one 2-rank spawn: a signal (and a second one) during a periodic save, and two more signals
  during the preemption save itself: each save finishes and nothing is torn;
- the grace period running out (SIGKILL) in the middle of a preemption save leaves the previous
  checkpoint loadable;
- the grace estimate and what `shardlab render` writes from it (the renders forked from one
  interpreter, tests/cli_batch.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.checkpoint import list_checkpoints, verify_checkpoint
from shardlab.config import load_config
from shardlab.loop import preemption
from shardlab.loop import train as T
from shardlab.testing import WorkerError, run_workers
from tests.checkpoint_helpers import assert_same_tensors, make_cfg, runtime
from tests.cli_batch import Command, run_commands

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
# a hang guard only, not a speed budget: each launch (start-up, a few steps, a checkpoint) takes
# 10-40 s idle and several times that at load 10 on 2 cores
HANG_GUARD_S = 600
CLI_OVERRIDES = ["parallel.strategy=fsdp", "model.preset=gpt-nano", "model.dropout=0.1", "data.source=synthetic",
                 "data.seq_len=32", "data.synthetic_samples=512", f"train.steps={STEPS}",
                 "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_batches=1",
                 "checkpoint.every_steps=5", "output.tensorboard=false", "output.progress=false",
                 "parallel.timeout_s=60"]


def step_path(run_dir: Path, step: int) -> str:
    return str(run_dir / "checkpoints" / f"step_{step:08d}")


def _launcher(out: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "shardlab", "train", "--nproc", "2", *CLI_OVERRIDES,
            f"output.dir={out}", f"output.run_name={name}"]


def _wait_for_checkpoint(root: Path, at_least: int, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + HANG_GUARD_S
    while proc.poll() is None:
        found = list_checkpoints(str(root)) if root.is_dir() else []
        if found and found[-1][0] >= at_least:
            return found[-1][0]
        assert time.monotonic() < deadline, f"hang guard: no checkpoint >= {at_least} in {root} after {HANG_GUARD_S} s"
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint >= {at_least} in {root} (process exit code {proc.poll()})")


def _signal_and_wait(cmd: list[str], log_path: Path, run_dir: Path, at_least: int, sig: int) -> tuple[int, float]:
    """Start cmd, send `sig` to it once a checkpoint >= at_least exists; (exit code, seconds to exit)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_for_checkpoint(run_dir / "checkpoints", at_least, proc)
            t0 = time.monotonic()
            os.kill(proc.pid, sig)
            rc = proc.wait(timeout=HANG_GUARD_S)
            return rc, time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _check_preempted(run_dir: Path, sig_name: str, log: Path) -> dict:
    record = json.loads((run_dir / "preempted.json").read_text())
    assert record["signal"] == sig_name and record["exit_code"] == preemption.PREEMPTED_EXIT_CODE
    assert 0 < record["step"] < STEPS
    newest = list_checkpoints(str(run_dir / "checkpoints"))[-1]
    assert newest[0] == record["step"], "the checkpoint is of the step the ranks agreed on"
    assert verify_checkpoint(newest[1])["step"] == record["step"]   # complete, every file's hash checks
    assert f"checkpoint of step {record['step']}" in log.read_text()
    return record


def _straight(rank: int, world: int, out: str) -> None:
    """The uninterrupted reference: the CLI runs' config through the training loop at the same world
    size (fsdp is exact across world sizes only up to reordering), in spawned workers. What the CLI
    test proves is the interrupted runs' way through the launchers; the reference only has to train
    the same config (build_run seeds everything from it), and a spawn costs less than a launch."""
    T.train(load_config(None, [*CLI_OVERRIDES, f"output.dir={out}", "output.run_name=straight"]),
            runtime(rank, world, "fsdp"))


@pytest.mark.slow  # three 2-worker launches and a 2-rank spawn: 60-150 s on a shared 2-core machine
@pytest.mark.timeout(4 * HANG_GUARD_S)   # the suite's pytest-timeout, 300 s, would be a speed budget here
def test_sigterm_then_sigusr1_resume_bitwise_equal(tmp_path):
    t_start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_workers(2, _straight, str(tmp_path), timeout_s=HANG_GUARD_S)
    run_dir = tmp_path / "preempted"
    # 1. SIGTERM to `shardlab train --nproc 2`
    rc, exit_s = _signal_and_wait(_launcher(tmp_path, "preempted"), tmp_path / "term.log", run_dir, 5,
                                  signal.SIGTERM)
    assert rc == preemption.PREEMPTED_EXIT_CODE, (tmp_path / "term.log").read_text()[-3000:]
    first = _check_preempted(run_dir, "SIGTERM", tmp_path / "term.log")
    assert not (run_dir / "metrics.json").exists()

    # 2. resumed under python -m shardlab.torchrun (what rendered jobs run), SIGUSR1 to the agent
    agent = [sys.executable, "-m", "shardlab.torchrun", "--standalone", "--nproc-per-node=2", "--shutdown-timeout=60",
             "-m", "shardlab", "train", str(run_dir / "config.yaml")]
    rc, exit_s2 = _signal_and_wait(agent, tmp_path / "usr1.log", run_dir, first["step"] + 5, signal.SIGUSR1)
    assert rc == preemption.PREEMPTED_EXIT_CODE, (tmp_path / "usr1.log").read_text()[-3000:]
    second = _check_preempted(run_dir, "SIGUSR1", tmp_path / "usr1.log")
    assert first["step"] + 5 <= second["step"] < STEPS

    # 3. the same command again finishes the run
    with open(tmp_path / "final.log", "w") as log:
        final = subprocess.run(_launcher(tmp_path, "preempted"), stdout=log, stderr=subprocess.STDOUT, env=env,
                               timeout=HANG_GUARD_S)
    assert final.returncode == 0, (tmp_path / "final.log").read_text()[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    reference = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    assert metrics["steps_this_run"] == STEPS - second["step"]
    assert metrics["losses"] == reference["losses"]
    assert_same_tensors(step_path(tmp_path / "straight", STEPS), step_path(run_dir, STEPS))
    print(f"\nsave {first['save_seconds']:.3f} s / {second['save_seconds']:.3f} s; signal to exit "
          f"{exit_s:.2f} s / {exit_s2:.2f} s; test {time.monotonic() - t_start:.1f} s")


# ------------------------------------------------------------------- signals during saves, in-process
def _patch_write(rank_: int, rank: int, step: int, action) -> None:
    """On `rank`, call action() while DCP writes the data of checkpoint `step`."""
    import torch.distributed.checkpoint.filesystem as fs

    if rank_ != rank:
        return
    original = fs.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if f"step_{step:08d}" in str(self.path):
            action()
        return original(self, plan, planner)

    fs.FileSystemWriter.write_data = write_data


def _signal_during_step(rank_: int, rank: int, step: int, sig: int) -> None:
    """On `rank`, the signal arrives while step `step` + 1 is computed (from inside the step)."""
    original = T.train_step

    def train_step(run, tracker=None):
        if rank_ == rank and run.state.step == step:
            os.kill(os.getpid(), sig)
        return original(run, tracker)

    T.train_step = train_step


def _expect_preempted(cfg, rt) -> dict:
    try:
        T.train(cfg, rt)
    except preemption.Preempted as p:
        return p.record
    raise AssertionError("the run was expected to stop on the signal")


def _during_saves(rank: int, world: int, out: str) -> dict:
    import torch.distributed.checkpoint.filesystem as fs

    rt = runtime(rank, world, "fsdp")
    res: dict = {}
    pristine_write, pristine_step = fs.FileSystemWriter.write_data, T.train_step
    try:
        # A: SIGTERM and then SIGUSR1 on rank 1 while the periodic save of step 4 writes
        _patch_write(rank, 1, 4, lambda: (os.kill(os.getpid(), signal.SIGTERM), os.kill(os.getpid(), signal.SIGUSR1)))
        res["A"] = _expect_preempted(make_cfg("fsdp", out, "during-periodic", steps=6, every=2), rt)
        fs.FileSystemWriter.write_data = pristine_write
        # B: SIGUSR1 on rank 0 during step 3; two SIGTERMs on rank 1 during the preemption save of step 3
        _signal_during_step(rank, 0, 2, signal.SIGUSR1)
        _patch_write(rank, 1, 3, lambda: (os.kill(os.getpid(), signal.SIGTERM), os.kill(os.getpid(), signal.SIGTERM)))
        res["B"] = _expect_preempted(make_cfg("fsdp", out, "during-preemption", steps=6, every=4), rt)
    finally:
        fs.FileSystemWriter.write_data, T.train_step = pristine_write, pristine_step
    # B resumes and finishes; a straight run to compare with
    res["B-resumed"] = T.train(make_cfg("fsdp", out, "during-preemption", steps=6, every=4), rt)["losses"]
    res["straight"] = T.train(make_cfg("fsdp", out, "straight", steps=6, every=4), rt)["losses"]
    return res


@pytest.fixture(scope="module")
def during_saves(tmp_path_factory):
    out = tmp_path_factory.mktemp("during")
    t0 = time.monotonic()
    results = run_workers(2, _during_saves, str(out), timeout_s=180)
    print(f"\n2-rank spawn with the in-process cases: {time.monotonic() - t0:.1f} s")
    return {"out": out, "ranks": results}


def test_signal_during_periodic_save_finishes_it(during_saves):
    r0, r1 = (r["A"] for r in during_saves["ranks"])
    run = during_saves["out"] / "during-periodic"
    assert r0["step"] == r1["step"] == 4          # the save under way finished; no further step was taken
    assert r1["signals_received_here"] == 2 and r0["signals_received_here"] == 0
    assert r0["signal"] == "SIGTERM"              # rank 0 learned rank 1's signal from the all-reduce
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [2, 4]
    assert json.loads((run / "preempted.json").read_text())["step"] == 4
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_signals_during_preemption_save_finish_it_and_resume_exactly(during_saves):
    r0, r1 = (r["B"] for r in during_saves["ranks"])
    out = during_saves["out"]
    assert r0["step"] == r1["step"] == 3 and r0["signal"] == r1["signal"] == "SIGUSR1"
    assert r1["signals_received_here"] == 2
    assert verify_checkpoint(step_path(out / "during-preemption", 3))["step"] == 3
    ranks = during_saves["ranks"]
    assert ranks[0]["B-resumed"] == ranks[0]["straight"]
    assert_same_tensors(step_path(out / "straight", 6), step_path(out / "during-preemption", 6))


def _killed_in_preemption_save(rank: int, world: int, out: str) -> None:
    def torn_then_killed():
        with open(os.path.join(out, "grace", "checkpoints", "step_00000003.tmp", "__1_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        os.kill(os.getpid(), signal.SIGKILL)  # the grace period ran out

    _signal_during_step(rank, 0, 2, signal.SIGTERM)
    _patch_write(rank, 1, 3, torn_then_killed)
    T.train(make_cfg("fsdp", out, "grace", "parallel.timeout_s=20", steps=6, every=2), runtime(rank, world, "fsdp"))


def test_grace_running_out_mid_save_keeps_previous_checkpoint(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(2, _killed_in_preemption_save, str(tmp_path), timeout_s=90)
    assert "rank 1: no result (exit code -9)" in str(info.value)
    root = tmp_path / "grace" / "checkpoints"
    assert (root / "step_00000003.tmp").is_dir()                  # torn, and ignored:
    assert [s for s, _ in list_checkpoints(str(root))] == [2]
    assert not (tmp_path / "grace" / "preempted.json").exists()   # no claim of a save that did not happen
    result = T.train(make_cfg("single", str(tmp_path), "after", f"checkpoint.dir={root}", steps=6, every=2),
                     runtime(0, 1, "single"))
    assert result["steps_this_run"] == 4
    print(f"\ngrace test {time.monotonic() - t0:.1f} s")


# ------------------------------------------------------------------------- estimate and rendering
def test_grace_estimate_sources(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "gpt-tiny.yaml"), [f"output.dir={tmp_path}", "output.run_name=r"])
    est = preemption.grace_estimate(cfg)
    assert est.source.startswith("estimated") and est.grace_s == int(-(-(2 * est.save_s + 30) // 1))
    # the estimate counts fp32 parameters + AdamW's two moments
    n = preemption.state_bytes(cfg) // 12
    assert 0.5e6 < n < 1.5e6
    cfg.preemption.save_s = 20.0
    assert preemption.grace_estimate(cfg).grace_s == 70
    cfg.preemption.grace_s = 12.5
    assert preemption.grace_estimate(cfg).grace_s == 13


def test_grace_estimate_uses_the_measured_save(tmp_path):
    cfg = make_cfg("single", str(tmp_path), "measured", steps=2, every=2)
    T.train(cfg, runtime(0, 1, "single"))
    est = preemption.grace_estimate(cfg)
    assert est.source.startswith("measured") and "step_00000002" in est.source
    manifest = verify_checkpoint(step_path(tmp_path / "measured", 2))
    assert est.save_s == manifest["save_seconds"]


def test_render_slurm_and_k8s_carry_the_grace(tmp_path):
    config = str(ROOT / "configs" / "gpt-tiny.yaml")
    # the three renders in one driver (tests/cli_batch.py: a process each, torch imported once)
    renders = run_commands([
        Command(["render", "slurm", config, "preemption.grace_s=90", "--nodes", "2", "--gpus-per-node", "0",
                 "--out", tmp_path / "s"]),
        Command(["render", "slurm", config, "preemption.enabled=false", "--no-requeue", "--out", tmp_path / "off"]),
        Command(["render", "k8s", config, "preemption.grace_s=60", "--nodes", "2", "--out", tmp_path / "k"])],
        timeout_s=120)
    for r in renders:
        assert r.returncode == 0, (r.args, r.stdout[-2000:], r.stderr[-3000:])
    text = (tmp_path / "s" / "shardlab.sbatch").read_text()
    for line in ("#SBATCH --signal=B:USR1@90", "#SBATCH --requeue", "trap 'forward_signal USR1' USR1",
                 "-m shardlab.torchrun", "--shutdown-timeout=90", 'scontrol requeue "$SLURM_JOB_ID"',
                 f'[ "$rc" = {preemption.PREEMPTED_EXIT_CODE} ]'):
        assert line in text, line
    off = (tmp_path / "off" / "shardlab.sbatch").read_text()
    assert "#SBATCH --signal" not in off and "#SBATCH --requeue" not in off and "scontrol requeue" not in off
    import yaml

    assert "15 s" in renders[2].stdout   # the GKE spot note: 60 s is more than spot pods get
    job = next(d for d in yaml.safe_load_all((tmp_path / "k" / "manifest.yaml").read_text()) if d and d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 65
    assert "--shutdown-timeout=60" in pod["containers"][0]["command"][-1]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                "values": [preemption.PREEMPTED_EXIT_CODE]}} in rules
