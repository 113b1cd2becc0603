"""A real Slurm run: a one-host cluster (slurmctld + slurmd on localhost) runs the rendered
sbatch file with two torchrun agents (two "nodes" worth) that rendezvous over c10d, on CPU
with gloo, and the run must finish with world size 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.infra, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "infra" / "slurm" / "local-cluster.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the one-host Slurm cluster needs root (slurmd runs jobs as any user)")
    state = tmp_path_factory.mktemp("slurm-state")
    os.chmod(state, 0o755)
    try:
        proc = subprocess.run(["bash", str(CLUSTER), "up", str(state)], capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired:
        subprocess.run(["bash", str(CLUSTER), "down", str(state)], timeout=60)
        pytest.skip("installing/starting Slurm took longer than 7 minutes")
    if proc.returncode == 3:
        pytest.skip(f"Slurm cannot be installed here: {proc.stderr.strip()}")
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER), "down", str(state)], timeout=60)


def job_state(env: dict, job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env, timeout=30).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def test_rendered_sbatch_runs_two_agents(slurm, tmp_path):
    out = tmp_path / "deploy"
    runs = tmp_path / "runs"
    render = subprocess.run(
        [sys.executable, "-m", "shardlab", "render", "slurm", str(ROOT / "configs" / "gpt-tiny.yaml"),
         "model.preset=gpt-nano", "data.seq_len=32", "train.steps=4", "output.progress=false",
         f"output.dir={runs}", "output.run_name=slurm-run",
         "--nodes", "2", "--gpus-per-node", "0", "--cpus-per-task", "1", "--max-restarts", "1",
         "--python", sys.executable, "--socket-ifname", "lo", "--rdzv-port", "29631",
         "--time", "00:05:00", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert render.returncode == 0, render.stderr
    # one host plays both nodes: 2 tasks on it, one torchrun agent per task (1 worker each)
    sub = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", str(out / "shardlab.sbatch")],
                         capture_output=True, text=True, env=slurm, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 150
    state = "PENDING"
    while time.monotonic() < deadline:
        state = job_state(slurm, job_id)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        time.sleep(2)
    else:
        subprocess.run(["scancel", job_id], env=slurm, timeout=30)
    logs = "\n".join(p.read_text() for p in (out / "logs").glob("*.out"))
    if state != "COMPLETED":
        info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=slurm,
                              timeout=30).stdout
        pytest.fail(f"job {job_id} ended {state}:\n{info}\nlog:\n{logs[-4000:]}")
    metrics = json.loads((runs / "slurm-run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["steps"] == 4
    assert "2 agent(s)" in logs
