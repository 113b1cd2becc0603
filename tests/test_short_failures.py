"""Failures a user can cause end short (issue 42): exit status != 0, at most 15 lines on stdout
and stderr together, the cause on the first line as `error: ...`, and no traceback.

Each case runs the real `shardlab` command on a small fixture: a file that is not safetensors, a
checkpoint whose data file was replaced (and its hash recorded anew), Hugging Face directories
that shardlab cannot read, out-of-range `generate`/`eval` flags and a global batch larger than the
data. The fixtures are made first and every command then runs in a process of its own, forked from
one interpreter that imported torch once (tests/cli_batch.py); each case is still its own test.
The checkpoint cases share one tiny single-process run, trained in this process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from shardlab.checkpoint import list_checkpoints, step_dir_name
from shardlab.config import load_config
from shardlab.data import GlobalBatchSampler
from shardlab.data.shards import DataError
from shardlab.loop import train as T
from shardlab.shipped import hf_config_path
from tests.checkpoint_helpers import runtime
from tests.cli_batch import PRELOAD, Command, run_commands

MAX_LINES = 15
TIMEOUT_S = 300  # a hang guard only: each command takes seconds
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# the tiny run: gpt-nano on synthetic data, a checkpoint at steps 1 and 2
TINY = ["parallel.strategy=single", "model.preset=gpt-nano", "data.source=synthetic", "data.seq_len=16",
        "data.synthetic_samples=64", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
        "train.warmup_steps=1", "train.eval_batches=1", "checkpoint.every_steps=1", "output.tensorboard=false",
        "output.progress=false"]


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


# ------------------------------------------------------------------------------ the cases, made then run together
# Each case makes its inputs in a directory of its own and returns its command line (and the
# environment it runs with); `ran` runs every case's command, then each test checks its own.
def _not_safetensors(d: Path, command: str, name: str) -> list:
    path = d / name
    path.write_bytes(b"some notes, not a model\n" if name.endswith(".txt") else os.urandom(4096))
    return [command, path, *(["--prompt", "hi"] if command == "generate" else [])]


def _tiny_run(out: Path) -> Path:
    """The checkpoint cases' run: trained once, in this process (one rank, no process group)."""
    T.train(load_config(None, [*TINY, f"output.dir={out}", "output.run_name=run"]), runtime(0, 1, "single"))
    run = out / "run"
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [1, 2]
    return run


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


def _data_replaced(d: Path, command: str, tiny: Path) -> list:
    run = shutil.copytree(tiny, d / "run")
    _replace_data_file(str(run / "checkpoints" / step_dir_name(2)))
    return {"eval": ["eval", run], "export": ["export", run, "--out", d / "model.safetensors"],
            "generate": ["generate", run, "--prompt", "hi", "--max-new-tokens", "2"],
            "resume": ["train", *TINY, "train.steps=3", f"output.dir={d}", "output.run_name=run",
                       "checkpoint.resume=auto"]}[command]


def _hf_dir(path: Path, model_type: str | None = None, weights: str = "model.safetensors") -> Path:
    """config.json of the shipped tiny Mistral (model_type replaced if given) and a weights file.
    The failures below come before any weight is read, so the weights need not match."""
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


def _hf_without_safetensors(d: Path, command: str) -> list:
    hf = _hf_dir(d / "hf", weights="pytorch_model.bin")
    return [command, hf, *(["--prompt", "hi"] if command == "generate" else [])]


def _hf_unknown_type(d: Path, command: str) -> list:
    hf = _hf_dir(d / "hf", model_type="no-such-model")
    return (["generate", hf, "--prompt", "hi"] if command == "generate"
            else ["train", "model.name=hf", f"model.hf_config={hf / 'config.json'}", "--nproc", "2"])


FLAGS = {"top-k": (["generate", "--prompt", "hi", "--top-k", "-3"], "argument --top-k: must be an integer >= 1"),
         "temperature": (["generate", "--prompt", "hi", "--temperature", "-1"],
                         "argument --temperature: must be a number >= 0"),
         "max-new-tokens": (["generate", "--prompt", "hi", "--max-new-tokens", "-5"],
                            "argument --max-new-tokens: must be an integer >= 1"),
         "batches": (["eval", "--batches", "0"], "argument --batches: must be an integer >= 1")}


def _sft_rows(d: Path) -> list:
    data = d / "tiny.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {i}", "output": f"{i} is a number"}) + "\n"
                            for i in range(3)))
    return ["train", "sft-mistral-tiny", "parallel.strategy=single", f"data.path={data}",
            "train.global_batch_size=16", f"output.dir={d}", "output.run_name=sft"]


def _cases(tiny: Path) -> dict[str, tuple]:
    """key -> (make(dir) -> argv, needs transformers)."""
    cases: dict[str, tuple] = {}
    for command, name in (("eval", "notes.txt"), ("generate", "junk.safetensors")):
        cases[f"not-safetensors-{command}"] = (lambda d, c=command, n=name: _not_safetensors(d, c, n), False)
    for command in ("eval", "export", "generate", "resume"):
        cases[f"data-{command}"] = (lambda d, c=command: _data_replaced(d, c, tiny), False)
    for command in ("generate", "eval"):
        cases[f"hf-no-safetensors-{command}"] = (lambda d, c=command: _hf_without_safetensors(d, c), True)
    for command in ("generate", "train"):
        cases[f"hf-unknown-{command}"] = (lambda d, c=command: _hf_unknown_type(d, c), True)
    for key, (args, _) in FLAGS.items():   # the model path does not exist
        cases[f"flag-{key}"] = (lambda d, a=args: [a[0], d / "no-such-run", *a[1:]], False)
    cases["batch-synthetic"] = (lambda d: ["train", *TINY, "train.global_batch_size=128", f"output.dir={d}",
                                           "output.run_name=big"], False)
    cases["batch-sft"] = (_sft_rows, False)
    return cases


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every case's directory and what its command did, all commands in one driver."""
    tiny = _tiny_run(tmp_path_factory.mktemp("tiny"))
    keys, commands = [], []
    for key, (make, needs_transformers) in _cases(tiny).items():
        if needs_transformers and not HAVE_TRANSFORMERS:
            continue
        d = tmp_path_factory.mktemp(key)
        keys.append((key, d))
        commands.append(Command(make(d), env={"SHARDLAB_CACHE": str(d / "cache")}))
    preload = (*PRELOAD, "transformers") if HAVE_TRANSFORMERS else PRELOAD
    done = run_commands(commands, preload=preload, timeout_s=TIMEOUT_S)
    return {key: (d, r) for (key, d), r in zip(keys, done)}


def _hf_case(ran: dict, key: str) -> tuple[Path, subprocess.CompletedProcess]:
    if not HAVE_TRANSFORMERS:
        pytest.skip("transformers is not installed")
    return ran[key]


# ------------------------------------------------------------------------------ not a safetensors file
@pytest.mark.parametrize("command, name", [("eval", "notes.txt"), ("generate", "junk.safetensors")])
def test_a_file_that_is_not_safetensors(ran, command, name):
    d, r = ran[f"not-safetensors-{command}"]
    fails_short(r, str(d / name), "is not a safetensors file", "shardlab export")


# ------------------------------------------------------------------------------ a checkpoint's data replaced
@pytest.mark.parametrize("command", ["eval", "export", "generate", "resume"])
def test_a_checkpoint_whose_data_does_not_parse(ran, command):
    d, r = ran[f"data-{command}"]
    run = d / "run"
    ckpt = run / "checkpoints" / step_dir_name(2)
    name = sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0]   # the file _replace_data_file replaced
    first = fails_short(r, f"checkpoint {ckpt}" if command == "resume" else "checkpoint ",
                        f"file {name}", "its tensor data cannot be read")
    # the way out: the previous checkpoint, which is not used behind the user's back
    assert f"previous complete checkpoint, {run / 'checkpoints' / step_dir_name(1)}" in first
    assert not (d / "model.safetensors").exists()


# ------------------------------------------------------------------------------ Hugging Face directories
@pytest.mark.parametrize("command", ["generate", "eval"])
def test_an_hf_directory_without_safetensors(ran, command):
    d, r = _hf_case(ran, f"hf-no-safetensors-{command}")
    fails_short(r, str(d / "hf"), "no model.safetensors", "safe_serialization=True")


@pytest.mark.parametrize("command", ["generate", "train"])
def test_an_unknown_model_type(ran, command):
    _, r = _hf_case(ran, f"hf-unknown-{command}")
    import transformers

    first = fails_short(r, "model_type 'no-such-model'", "unknown to the installed transformers",
                        transformers.__version__, "pip install -U transformers")
    assert len(first) < 400  # not transformers' list of every model type it knows


# ------------------------------------------------------------------------------ flags out of range
@pytest.mark.parametrize("key", list(FLAGS))
def test_flags_out_of_range_are_refused_before_loading(ran, key):
    """The model path does not exist: the flag is refused before anything is loaded."""
    _, r = ran[f"flag-{key}"]
    assert r.returncode == 2
    fails_short(r, FLAGS[key][1])


# ------------------------------------------------------------------------------ a batch larger than the data
def test_a_global_batch_larger_than_synthetic_data(ran):
    d, r = ran["batch-synthetic"]
    fails_short(r, "data.source=synthetic", "has 64 rows", "fewer than one global batch",
                "train.global_batch_size=128", "raise data.synthetic_samples")
    assert not (d / "big").exists()  # refused before the run started


def test_a_global_batch_larger_than_sft_data(ran):
    d, r = ran["batch-sft"]
    fails_short(r, f"data.source=sft ({d / 'tiny.jsonl'})", "fewer than one global batch",
                "train.global_batch_size=16", "lower train.global_batch_size")
    assert not (d / "sft").exists()


def test_the_sampler_says_rows_and_batch():
    """The last line of defence, for data whose size only the workers see."""
    with pytest.raises(DataError, match=r"has 3 rows, fewer than one global batch \(train.global_batch_size=4\)"):
        GlobalBatchSampler(3, 4)
