"""Failures a user can cause end short (issue 42): exit status != 0, at most 15 lines on stdout
and stderr together, the cause on the first line as `error: ...`, and no traceback.

Each case runs the real `shardlab` command in a subprocess on a small fixture: a file that is
not safetensors, a checkpoint whose data file was replaced (and its hash recorded anew), Hugging
Face directories that shardlab cannot read, out-of-range `generate`/`eval` flags and a global
batch larger than the data. The checkpoint cases share one tiny single-process run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from shardlab.checkpoint import list_checkpoints, step_dir_name
from shardlab.data.sampler import GlobalBatchSampler
from shardlab.data.shards import DataError
from shardlab.shipped import hf_config_path

MAX_LINES = 15
TIMEOUT_S = 300  # a hang guard only: each command takes seconds
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# the tiny run: gpt-nano on synthetic data, a checkpoint at steps 1 and 2
TINY = ["parallel.strategy=single", "model.preset=gpt-nano", "data.source=synthetic", "data.seq_len=16",
        "data.synthetic_samples=64", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
        "train.warmup_steps=1", "train.eval_batches=1", "checkpoint.every_steps=1", "output.tensorboard=false",
        "output.progress=false"]


def _shardlab(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlab", *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=ENV, cwd=cwd)


def fails_short(r: subprocess.CompletedProcess, *cause: str) -> str:
    """Assert the short-failure contract; returns the first line."""
    out = r.stdout + r.stderr
    lines = out.splitlines()
    assert r.returncode != 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert 1 <= len(lines) <= MAX_LINES, out[-3000:]
    assert lines[0].startswith("error: "), out[-3000:]
    for word in cause:
        assert word in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------ not a safetensors file
@pytest.mark.parametrize("command, name", [("eval", "notes.txt"), ("generate", "junk.safetensors")])
def test_a_file_that_is_not_safetensors(tmp_path, command, name):
    path = tmp_path / name
    path.write_bytes(b"some notes, not a model\n" if name.endswith(".txt") else os.urandom(4096))
    extra = ["--prompt", "hi"] if command == "generate" else []
    fails_short(_shardlab(command, path, *extra), str(path), "is not a safetensors file", "shardlab export")


# ------------------------------------------------------------------------------ a checkpoint's data replaced
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny")
    r = _shardlab("train", *TINY, f"output.dir={out}", "output.run_name=run")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run = out / "run"
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [1, 2]
    return str(run)


def _replace_data_file(ckpt: str) -> str:
    """Replace a data file's bytes (same size) and record their hash in the manifest, as a copy
    gone wrong or an edit would: the hashes pass and only reading the tensors can tell."""
    name = sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0]
    path = os.path.join(ckpt, name)
    data = bytes(os.path.getsize(path))  # zeros: no tensor torch.save wrote
    with open(path, "wb") as f:
        f.write(data)
    manifest_path = os.path.join(ckpt, "shardlab.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["sha256"][name] = hashlib.sha256(data).hexdigest()
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return name


@pytest.mark.parametrize("command", ["eval", "export", "generate", "resume"])
def test_a_checkpoint_whose_data_does_not_parse(tiny_run, tmp_path, command):
    run = shutil.copytree(tiny_run, tmp_path / "run")
    ckpt = run / "checkpoints" / step_dir_name(2)
    name = _replace_data_file(str(ckpt))
    args = {"eval": ["eval", run], "export": ["export", run, "--out", tmp_path / "model.safetensors"],
            "generate": ["generate", run, "--prompt", "hi", "--max-new-tokens", "2"],
            "resume": ["train", *TINY, "train.steps=3", f"output.dir={tmp_path}", "output.run_name=run",
                       "checkpoint.resume=auto"]}[command]
    first = fails_short(_shardlab(*args), f"checkpoint {ckpt}" if command == "resume" else "checkpoint ",
                        f"file {name}", "its tensor data cannot be read")
    # the way out: the previous checkpoint, which is not used behind the user's back
    assert f"previous complete checkpoint, {run / 'checkpoints' / step_dir_name(1)}" in first
    assert not (tmp_path / "model.safetensors").exists()


# ------------------------------------------------------------------------------ Hugging Face directories
def _hf_dir(path, model_type: str | None = None, weights: str = "model.safetensors"):
    """config.json of the shipped tiny Mistral (model_type replaced if given) and a weights file.
    The failures below come before any weight is read, so the weights need not match."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    path.mkdir()
    with open(hf_config_path("mistral-tiny")) as f:
        raw = json.load(f)
    if model_type is not None:
        raw["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(raw))
    if weights.endswith(".safetensors"):
        save_file({"x": torch.zeros(1)}, str(path / weights))
    else:
        torch.save({"x": torch.zeros(1)}, path / weights)
    return path


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_an_hf_directory_without_safetensors(tmp_path, command):
    hf = _hf_dir(tmp_path / "hf", weights="pytorch_model.bin")
    extra = ["--prompt", "hi"] if command == "generate" else []
    fails_short(_shardlab(command, hf, *extra), str(hf), "no model.safetensors", "safe_serialization=True")


@pytest.mark.parametrize("command", ["generate", "train"])
def test_an_unknown_model_type(tmp_path, command):
    import transformers

    hf = _hf_dir(tmp_path / "hf", model_type="no-such-model")
    args = (["generate", hf, "--prompt", "hi"] if command == "generate"
            else ["train", "model.name=hf", f"model.hf_config={hf / 'config.json'}", "--nproc", "2"])
    first = fails_short(_shardlab(*args), "model_type 'no-such-model'", "unknown to the installed transformers",
                        transformers.__version__, "pip install -U transformers")
    assert len(first) < 400  # not transformers' list of every model type it knows


# ------------------------------------------------------------------------------ flags out of range
@pytest.mark.parametrize("args, cause", [
    (["generate", "--prompt", "hi", "--top-k", "-3"], "argument --top-k: must be an integer >= 1"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "argument --temperature: must be a number >= 0"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be an integer >= 1"),
    (["eval", "--batches", "0"], "argument --batches: must be an integer >= 1"),
], ids=["top-k", "temperature", "max-new-tokens", "batches"])
def test_flags_out_of_range_are_refused_before_loading(tmp_path, args, cause):
    """The model path does not exist: the flag is refused before anything is loaded."""
    r = _shardlab(args[0], tmp_path / "no-such-run", *args[1:])
    assert r.returncode == 2
    fails_short(r, cause)


# ------------------------------------------------------------------------------ a batch larger than the data
def test_a_global_batch_larger_than_synthetic_data(tmp_path):
    r = _shardlab("train", *TINY, "train.global_batch_size=128", f"output.dir={tmp_path}", "output.run_name=big")
    fails_short(r, "data.source=synthetic", "has 64 rows", "fewer than one global batch",
                "train.global_batch_size=128", "raise data.synthetic_samples")
    assert not (tmp_path / "big").exists()  # refused before the run started


def test_a_global_batch_larger_than_sft_data(tmp_path):
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {i}", "output": f"{i} is a number"}) + "\n"
                            for i in range(3)))
    r = subprocess.run([sys.executable, "-m", "shardlab", "train", "sft-mistral-tiny", "parallel.strategy=single",
                        f"data.path={data}", "train.global_batch_size=16", f"output.dir={tmp_path}",
                        "output.run_name=sft"], capture_output=True, text=True, timeout=TIMEOUT_S,
                       env={**ENV, "SHARDLAB_CACHE": str(tmp_path / "cache")})
    fails_short(r, f"data.source=sft ({data})", "fewer than one global batch", "train.global_batch_size=16",
                "lower train.global_batch_size")
    assert not (tmp_path / "sft").exists()


def test_the_sampler_says_rows_and_batch():
    """The last line of defence, for data whose size only the workers see."""
    with pytest.raises(DataError, match=r"has 3 rows, fewer than one global batch \(train.global_batch_size=4\)"):
        GlobalBatchSampler(3, 4)
