"""model.hf_path's safetensors files checked from their headers before any worker starts
(shardlab.models.safetensors_check): each kind of damage is one error naming the file."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardlab.errors import ConfigError
from shardlab.models.safetensors_check import check_safetensors_dir, check_safetensors_file

ROOT = Path(__file__).resolve().parents[1]
TENSORS = {"w": torch.zeros(4, 3), "b": torch.ones(5, dtype=torch.bfloat16)}


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(TENSORS, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def _rewrite_header(file: Path, edit) -> None:  # noqa: ANN001 - edit: header dict -> header dict
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.dumps(edit(json.loads(data[8:8 + n]))).encode()
    file.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        check_safetensors_dir(str(path))
    text = str(e.value)
    assert "\n" not in text and "save_pretrained" in text
    return text


def test_a_whole_file_passes_and_its_names_are_read(tmp_path):
    d = _model_dir(tmp_path / "ok")
    check_safetensors_dir(str(d))
    assert check_safetensors_file(str(d / "model.safetensors")) == {"w", "b"}


def test_truncated_file(tmp_path):
    d = _model_dir(tmp_path / "m")
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size - 4)
    assert f"{f}: tensor " in _error(d) and "truncated" in _error(d)
    os.truncate(f, 5)  # not even the header length
    assert f"{f}: 5 bytes, shorter than the 8-byte header length" in _error(d)
    os.truncate(f, 40)  # a header length, part of the header
    assert "the header claims" in _error(d)


def test_zeroed_header(tmp_path):
    d = _model_dir(tmp_path / "m")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:64] = bytes(64)
    f.write_bytes(bytes(data))
    assert f"{f}: the header length is 0" in _error(d)


def test_header_that_is_not_json(tmp_path):
    d = _model_dir(tmp_path / "m")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff{{{"
    f.write_bytes(bytes(data))
    assert "header is not valid JSON" in _error(d)


def test_offsets_past_the_end_and_lengths_that_disagree(tmp_path):
    d = _model_dir(tmp_path / "m")
    f = d / "model.safetensors"
    original = f.read_bytes()

    def past_end(h):  # noqa: ANN001, ANN202
        h["b"]["data_offsets"] = [h["b"]["data_offsets"][0] + 8, h["b"]["data_offsets"][1] + 8]
        return h

    _rewrite_header(f, past_end)
    assert "tensor 'b' ends at data byte" in _error(d) and "past the file's" in _error(d)
    f.write_bytes(original)

    def wrong_shape(h):  # noqa: ANN001, ANN202
        h["w"]["shape"] = [4, 4]
        return h

    _rewrite_header(f, wrong_shape)
    assert "tensor 'w' (F32 [4, 4]) needs 64 bytes" in _error(d)
    f.write_bytes(original + b"\0" * 16)   # data after the last tensor
    assert "16 bytes after the last tensor" in _error(d)


def test_index_naming_a_missing_shard_or_a_tensor_a_shard_lacks(tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    save_file({"w": TENSORS["w"]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": TENSORS["b"]}, str(d / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    check_safetensors_dir(str(d))
    index["weight_map"]["extra"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00001-of-00002.safetensors: model.safetensors.index.json places 1 tensor(s)" in _error(d)
    index["weight_map"].pop("extra")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model-00002-of-00002.safetensors").unlink()
    assert "names model-00002-of-00002.safetensors, which is not in" in _error(d)


def test_train_with_a_truncated_file_stops_before_any_worker(tmp_path):
    d = _model_dir(tmp_path / "m")
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size - 4)
    out = subprocess.run([sys.executable, "-m", "shardlab", "train", "model.name=hf", f"model.hf_path={d}",
                          "--nproc", "2", f"output.dir={tmp_path / 'runs'}"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2 and len(lines) <= 3, lines
    assert str(f) in lines[-1] and "truncated" in lines[-1]
    assert not (tmp_path / "runs").exists()   # the launcher, which creates the run directory, never ran
