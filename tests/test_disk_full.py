"""A filesystem that fills up (checkpoint/space.py, doctor/agent.py): the real CLI on a small tmpfs
says which checkpoint did not fit, that the previous one is intact and the space needed, in a few
lines and without a traceback, leaves nothing half written, and resumes once there is space; the
launcher's own view when the disk is too full for the workers' records. Mounting needs root:
without it the tests are skipped, saying so."""

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from shardlab.checkpoint import list_checkpoints


def _mount(path: Path, size: str) -> None:
    path.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs for the disk-full test (needs root): {done.stderr.strip()}")


def _unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


def _half_written(root: Path) -> list[str]:
    """Temporary files of atomic writes (.tmp-*), torn checkpoints (step_N.tmp) and other .tmp files."""
    return [str(p) for p in root.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]


@pytest.mark.slow
def test_a_checkpoint_that_fills_the_disk_is_said_and_the_run_resumes(tmp_path):
    """gpt-tiny's checkpoint is 10.1 MiB: on a 20 MiB tmpfs step 2's fits and step 4's does not."""
    disk = tmp_path / "small"
    _mount(disk, "20m")
    try:
        cmd = [sys.executable, "-m", "shardlab", "train", "configs/gpt-tiny.yaml", "--nproc", "2", f"output.dir={disk}",
               "output.run_name=r", "checkpoint.every_steps=2", "train.steps=4", "output.progress=false"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        said = out.stdout + out.stderr
        assert out.returncode != 0, said
        assert len(said.splitlines()) <= 15 and "Traceback" not in said, said
        err = out.stderr.splitlines()
        ckpts = disk / "r" / "checkpoints"
        assert err[0].startswith("error: disk full: checkpoint step 4") and str(ckpts / "step_00000004") in err[0], said
        assert "ENOSPC" in err[0]
        assert any(f"the previous checkpoint, step 2 ({ckpts / 'step_00000002'}), is intact: the same command "
                   "resumes from it" in line for line in err), said
        assert re.search(r"needs about 10\.\d MiB \(step 2's size\); \d+\.\d MiB free of 20\.0 MiB", out.stderr), said
        assert not _half_written(disk), _half_written(disk)
        assert [s for s, _ in list_checkpoints(str(ckpts))] == [2]

        subprocess.run(["mount", "-o", "remount,size=40m", str(disk)], check=True)  # space freed
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert f"shardlab: resumed from step 2 of {disk / 'r'}" in again.stdout
        metrics = json.loads((disk / "r" / "metrics.json").read_text())
        assert metrics["steps"] == 4 and len(metrics["losses"]) == 4 and metrics["steps_this_run"] == 2
        assert [(a["world_size"], a["steps_from"], a["steps_to"]) for a in metrics["attempts"]] == [(2, 0, 4), (2, 2, 4)]  # steps 3-4 trained twice: the save of 4 failed
        assert not _half_written(disk), _half_written(disk)
    finally:
        _unmount(disk)


def test_the_launcher_says_a_disk_too_full_for_the_workers_records(tmp_path):
    """The workers left no record (the disk stayed full): the launcher's own record write fails
    without a traceback or a temporary file, and its lines say the disk is full, first, and what
    the same command resumes from; a torn checkpoint directory is removed."""
    from shardlab.checkpoint.space import full_filesystem_lines
    from shardlab.doctor import agent

    disk = tmp_path / "full"
    _mount(disk, "1m")
    try:
        run, ckpts = disk / "run", disk / "run" / "checkpoints"
        (ckpts / "step_00000004.tmp").mkdir(parents=True)
        (run / "debug").mkdir()
        with open(disk / "filler", "wb") as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        failures = {0: types.SimpleNamespace(exitcode=1, pid=1, timestamp=0, local_rank=0, message="")}
        error = agent.record_exits(str(run), "launch", failures)
        assert isinstance(error, OSError) and not _half_written(run / "debug")
        disk_lines = full_filesystem_lines(str(run), str(ckpts), error, remove_partial=True)
        lines = agent.failure_lines(str(run), agent.analysis.diagnose(str(run)), failures, None, 0, disk_lines)
        assert lines[0].startswith(f"error: disk full: the filesystem of {run} is full"), lines
        assert "step_00000004.tmp was removed" in lines[0] and not (ckpts / "step_00000004.tmp").exists()
        assert "no earlier complete checkpoint: the same command starts the run again from step 0" in lines[1]
        assert len(lines) <= 6 and not any("a worker was lost" in line for line in lines), lines
    finally:
        _unmount(disk)


def test_a_run_directory_on_a_full_disk_is_one_line_before_any_worker(tmp_path):
    disk = tmp_path / "full"
    _mount(disk, "1m")
    try:
        (disk / "filler").write_bytes(b"")
        with open(disk / "filler", "wb") as f:   # fill it
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        out = subprocess.run([sys.executable, "-m", "shardlab", "train", "configs/gpt-tiny.yaml", "--nproc", "2",
                              "model.preset=gpt-nano", "data.seq_len=32", f"output.dir={disk}"],
                             capture_output=True, text=True, timeout=300)
        said = out.stdout + out.stderr
        assert out.returncode == 1 and "Traceback" not in said and len(said.splitlines()) <= 15, said
        assert out.stderr.startswith(f"error: cannot write the run directory {disk}/"), said
        assert "No space left on device" in out.stderr.splitlines()[0]
    finally:
        _unmount(disk)
