"""The Python entry to shardlab's loop (src/shardlab/entry.py, docs/python.md): docs/python.md's three
examples run at 2 ranks, and a user's own model and dataset (tests/python_entry_user.py) trains through
`shardlab.fit` at 2 ranks, is killed, resumes at 3 ranks equal to an uninterrupted run in float64,
verifies EQUAL and is drawn by `shardlab report`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardlab
from shardlab.checkpoint import list_checkpoints
from shardlab.checkpoint.reader import read_model_state

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES, TESTS = ROOT / "examples", ROOT / "tests"
HANG_GUARD_S = 600  # a hang guard only: each launch takes 10-40 s on this 2-core machine, idle or loaded
TORCHRUN = [sys.executable, "-m", "shardlab.torchrun"]
QUIET = ["output.progress=false", "output.tensorboard=false"]


def _env(plugin: str | None = None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    if plugin is not None:  # the module that registers, importable by the other commands' processes
        env["SHARDLAB_PLUGINS"] = plugin
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES), str(TESTS), env.get("PYTHONPATH")) if p)
    return env


def _run(cmd: list, log: Path, **env: str) -> str:
    with open(log, "w") as f:
        done = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=_env(**env),
                              timeout=HANG_GUARD_S)
    text = log.read_text()
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} -> {done.returncode}:\n{text[-3000:]}"
    return text


# -- the three ways in, as docs/python.md shows them ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(2 * HANG_GUARD_S)
def test_own_loop_example(tmp_path):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                EXAMPLES / "python_parallelize.py", "zero3", tmp_path], tmp_path / "log")
    assert "zero3 on 2 ranks: last loss" in out and "a plain nn.Sequential loads them" in out
    assert (tmp_path / "model.pt").exists() and (tmp_path / "dcp" / ".metadata").exists()


@pytest.mark.slow
@pytest.mark.timeout(2 * HANG_GUARD_S)
def test_fit_example(tmp_path):
    _run([*TORCHRUN, "--nproc-per-node", "2", EXAMPLES / "python_fit.py", f"output.dir={tmp_path}",
          "train.steps=2", *QUIET], tmp_path / "log")
    metrics = json.loads((tmp_path / "python-fit" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 2 and metrics["strategy"] == "fsdp"
    assert metrics["losses"][1] < metrics["losses"][0]  # loss=F.mse_loss from register_model: it learns


@pytest.mark.slow
@pytest.mark.timeout(2 * HANG_GUARD_S)
def test_cli_plugin_example(tmp_path):
    _run([sys.executable, "-m", "shardlab", "train", "--nproc", "2", "model.name=wide-mlp", "model.wide_width=48",
          "data.source=synthetic", "train.steps=2", f"output.dir={tmp_path}", "output.run_name=wide", *QUIET],
         tmp_path / "log", plugin="python_plugin")
    run_args = json.loads((tmp_path / "wide" / "run_args.json").read_text())
    assert run_args["config"]["model"]["wide_width"] == 48
    assert run_args["num_parameters"] == 16 * 48 + 48 + 48 * 48 + 48 + 48 * 4 + 4


# -- a user's model: killed at 2 ranks, resumed at 3, verified, reported ---------------------------------
def _kill_when_saved(cmd: list, root: Path, step: int, log: Path) -> None:
    """Start cmd (the user script stalls after `step`'s samples), wait for the checkpoint of `step`,
    SIGKILL the workers and their agent."""
    with open(log, "w") as f:
        agent = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=_env(STALL_AFTER=str(step * 6)))  # 6 samples per rank and step at 2 ranks
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not list_checkpoints(str(root)) or list_checkpoints(str(root))[-1][0] < step:
            assert agent.poll() is None, f"the run ended before it was killed:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"hang guard: no checkpoint of step {step} after {HANG_GUARD_S} s"
            time.sleep(0.05)
    finally:
        for pid in _children(agent.pid):  # the agent starts its workers in sessions of their own
            os.kill(pid, signal.SIGKILL)
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(4 * HANG_GUARD_S)
def test_user_model_killed_at_2_resumes_at_3_exactly_verifies_and_reports(tmp_path):
    script, out = TESTS / "python_entry_user.py", f"output.dir={tmp_path}"
    _run([sys.executable, script, out, "output.run_name=straight"], tmp_path / "straight.log")  # one process
    killed = [*TORCHRUN, "--nproc-per-node", "2", script, out, "output.run_name=user"]
    _kill_when_saved(killed, tmp_path / "user" / "checkpoints", 2, tmp_path / "killed.log")
    assert not (tmp_path / "user" / "metrics.json").exists()
    text = _run([*TORCHRUN, "--nproc-per-node", "3", script, out, "output.run_name=user"], tmp_path / "resumed.log")
    assert "resumed from step 2" in text

    straight, resumed = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("straight", "user"))
    assert resumed["world_size"] == 3 and resumed["steps_this_run"] == 4
    # float64: the same steps at 1, 2 and 3 ranks differ only in the order of the sums
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"]), rtol=1e-12, atol=0)
    (_, last_straight), (_, last_resumed) = (list_checkpoints(str(tmp_path / n / "checkpoints"))[-1]
                                             for n in ("straight", "user"))
    a, b = read_model_state(last_straight)[0], read_model_state(last_resumed)[0]
    assert a.keys() == b.keys() == {"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
                                    "head.weight", "head.bias"}
    for name in a:
        assert a[name].dtype == torch.float64
        torch.testing.assert_close(b[name], a[name], rtol=1e-12, atol=1e-14, msg=name)

    verdict = _run([sys.executable, "-m", "shardlab", "verify", tmp_path / "user" / "config.yaml", "--nproc", "2",
                    "--steps", "2"], tmp_path / "verify.log", plugin="python_entry_user")
    assert "EQUAL" in verdict, verdict[-3000:]
    from shardlab.cli import main  # the report reads files only: drawn in this process

    assert main(["report", str(tmp_path / "user")]) == 0
    html = (tmp_path / "user" / "report.html").read_text()
    assert "user-classifier" in html and "<img" in html


# -- the entry's own checks, in this process ------------------------------------------------------------
def test_registration_refuses_the_catalogue_names_and_bad_kinds():
    with pytest.raises(ValueError, match="shardlab's own"):
        shardlab.register_model("gpt", lambda: torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="shardlab's own"):
        shardlab.register_data("synthetic", lambda cfg: None)
    with pytest.raises(ValueError, match="data_kind 'pixels'"):
        shardlab.register_model("mine", lambda: torch.nn.Linear(1, 1), data_kind="pixels")


def test_with_loss_keeps_the_module_names():
    from shardlab.entry import with_loss

    plain = torch.nn.Sequential(torch.nn.Linear(3, 2))
    names = list(plain.state_dict())
    model = with_loss(plain, torch.nn.functional.mse_loss)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    assert list(model.state_dict()) == names and isinstance(model, torch.nn.Sequential)
    torch.testing.assert_close(model(x, y), torch.nn.functional.mse_loss(plain[0](x), y))
    assert model(x).shape == (4, 2)


def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        shardlab.fit({"train.stepz": 3, "output.dir": str(tmp_path)})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown config key 'train.stepz'") and "\n" not in err
