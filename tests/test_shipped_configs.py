"""The example configs ship inside the package ([Note: one copy of the configs] in
shardlab/shipped.py): `shardlab configs` lists them, `shardlab train NAME` runs one, the repository's
configs/ is the same files, and a wheel built from the repository, installed into a fresh
environment outside it, trains a shipped config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from shardlab.shipped import (
    CONFIG_DIR,
    config_path,
    describe,
    hf_config_path,
    shipped_configs,
    shipped_hf_configs,
)

REPO = Path(__file__).resolve().parents[1]


def test_repository_configs_are_the_shipped_ones():
    """One copy: configs/ is a link to the package's directory, not a second set of files."""
    assert (REPO / "configs").is_symlink() and (REPO / "configs").resolve() == CONFIG_DIR.resolve()
    assert {"gpt-tiny", "sft-mistral-tiny", "sft-mistral-7b", "gpt2-small", "resnet-cifar10"} <= set(shipped_configs())
    assert "mistral-tiny" in shipped_hf_configs()
    assert all(describe(p) for p in shipped_configs().values())


def test_names_resolve_and_paths_still_win(tmp_path, monkeypatch):
    assert config_path("sft-mistral-tiny") == str(CONFIG_DIR / "sft-mistral-tiny.yaml")
    assert config_path("sft-mistral-tiny.yaml") == str(CONFIG_DIR / "sft-mistral-tiny.yaml")
    assert config_path("configs/nope.yaml") is None and config_path("nope") is None
    assert hf_config_path("mistral-tiny") == str(CONFIG_DIR / "hf" / "mistral-tiny.json")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt-tiny").write_text("seed: 3\n")  # a file of that name here is the user's, not ours
    assert config_path("gpt-tiny") == "gpt-tiny"


def test_configs_command_and_train_by_name(capsys):
    from shardlab.cli import main

    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in shipped_configs())
    assert main(["configs", "gpt-tiny"]) == 0
    assert capsys.readouterr().out == (CONFIG_DIR / "gpt-tiny.yaml").read_text()
    assert main(["train", "sft-mistral-tiny", "--print-config"]) == 0
    assert "hf_config: mistral-tiny" in capsys.readouterr().out
    assert main(["train", "no-such-config"]) == 2
    assert "sft-mistral-tiny" in capsys.readouterr().err


def _build_env() -> dict[str, str]:
    """The environment of the no-isolation build. setuptools >= 77 needs packaging >= 24.2 for the
    SPDX license expression, while checkov (extra infra) pins packaging < 24 in this environment;
    setuptools carries its own newer copy (setuptools/_vendor), which then goes first on the path."""
    import importlib.util

    import setuptools

    if importlib.util.find_spec("packaging.licenses") is not None:
        return dict(os.environ)
    vendored = Path(setuptools.__file__).parent / "_vendor"
    if not (vendored / "packaging" / "licenses").is_dir():
        pytest.skip("no packaging >= 24.2 here (setuptools needs it to build the wheel) and none vendored")
    return {**os.environ, "PYTHONPATH": str(vendored)}


@pytest.mark.slow
def test_built_wheel_trains_a_shipped_config_outside_the_repository(tmp_path):
    """pip wheel (no build isolation, no downloads) of a copy of the repository's package files,
    installed with --no-deps into a fresh venv whose dependencies come from this environment's
    site-packages (a .pth line), then `shardlab configs` and one step of `shardlab train
    sft-mistral-tiny` from a directory outside the repository."""
    src = tmp_path / "src-copy"
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=240,
                           env=_build_env())
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("shardlab-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=240)
    site = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps-from-the-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "SHARDLAB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)

    def shardlab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "shardlab"), *args], cwd=elsewhere, env=env, capture_output=True,
                              text=True, timeout=240)

    where = subprocess.run([venv / "bin" / "python", "-c", "import shardlab; print(shardlab.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(site), where  # the wheel's copy, not the repository's
    listed = shardlab("configs")
    assert listed.returncode == 0 and "sft-mistral-tiny" in listed.stdout, listed.stderr
    run = shardlab("train", "sft-mistral-tiny", "parallel.strategy=single", "train.steps=1",
                   "train.global_batch_size=4", "train.micro_batch_size=4", "data.seq_len=64", "output.run_name=r",
                   "output.progress=false", "output.tensorboard=false", "train.memory_tracking=none")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    metrics = json.loads((elsewhere / "runs" / "r" / "metrics.json").read_text())
    assert metrics["steps"] == 1 and metrics["final_loss"] > 0
    assert (elsewhere / "runs" / "r" / "hf" / "config.json").exists()
