"""Loading a checkpoint never runs code from it, and a damaged one stops with a clear error.

DCP keeps a checkpoint's `.metadata` as a pickle. The CLI cases tamper with copies of one run
trained once for the module (2 ranks, fsdp, checkpoints at steps K and TOTAL, in the module's
one spawn, beside a short run of every other engine) and run `shardlab train ...
checkpoint.resume=auto`, `export`, `eval` and `generate` on them, each in a process of its own
(forked from one interpreter that imported torch once: tests/cli_batch.py), and a resume by
`shardlab train --nproc 2` under the launcher: the crafted pickle's command never runs, the exit
status is 1, stderr is one `error:` line naming the file, and nothing prints a traceback. The
unit cases check the restricted unpickler against the real metadata every engine writes, and the
manifest's hashes against the files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from shardlab.checkpoint import (
    CheckpointError,
    list_checkpoints,
    read_dcp_metadata,
    read_model_state,
    read_tensors,
    verify_checkpoint,
)
from shardlab.loop import train as T
from shardlab.testing import run_workers
from tests.checkpoint_helpers import TOTAL, K, make_cfg, overrides, runtime
from tests.cli_batch import Command, run_commands

pytestmark = pytest.mark.slow  # one 2-rank spawn for the module, one driver for the CLI cases, one launch

CKPT = "checkpoints/step_{:08d}"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------ tampering
class _RunsCommand:
    """Unpickling this runs a shell command: what an attacker puts in a `.metadata`."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def crafted_metadata(ckpt: str, marker: str) -> bytes:
    """The checkpoint's own metadata (read with plain pickle: it was written by this test's
    run) with a payload that creates `marker` hidden in its planner data. Plain pickle.load
    of it creates the file and then returns a valid Metadata, so a vulnerable loader goes on
    as if nothing happened."""
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        md = pickle.load(f)
    md.planner_data["x"] = _RunsCommand(f"touch {shlex.quote(marker)}")
    return pickle.dumps(md)


def _rewrite_manifest(ckpt: str, name: str, data: bytes, *, rehash: bool) -> None:
    path = os.path.join(ckpt, "shardlab.json")
    with open(path) as f:
        m = json.load(f)
    m["files"][name] = len(data)
    if rehash:
        m["sha256"][name] = hashlib.sha256(data).hexdigest()
    with open(path, "w") as f:
        json.dump(m, f)


def tamper(ckpt: str, kind: str, marker: str) -> str:
    """Damage checkpoint `ckpt` in one of three ways; returns the file that was changed."""
    if kind in ("evil-metadata", "evil-metadata-rehashed"):
        data = crafted_metadata(ckpt, marker)
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            f.write(data)
        # the size always fits (else the cheap size check would already refuse it); with
        # -rehashed the attacker rewrote the recorded hash too, so only the unpickler stands
        _rewrite_manifest(ckpt, ".metadata", data, rehash=kind.endswith("rehashed"))
        return ".metadata"
    assert kind == "bitflip"
    name = "__1_0.distcp"  # rank 1's data file: one bit in the middle, size unchanged
    with open(os.path.join(ckpt, name), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(ckpt, name)) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    return name


def test_the_crafted_metadata_runs_code_under_plain_pickle(trained, tmp_path):
    """Control: the payload is live, so its absence below means the loader refused it."""
    marker = tmp_path / "marker"
    data = crafted_metadata(os.path.join(trained, CKPT.format(TOTAL)), str(marker))
    assert not marker.exists()
    pickle.loads(data)  # the point of this control
    assert marker.exists()


# ------------------------------------------------------------------------------ CLI, end to end
def _shardlab(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlab", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def _train_every_engine(rank: int, world: int, out: str) -> list[str]:
    """The CLI cases' run (fsdp, checkpoints at K and TOTAL) and one short run per other engine (plus
    fsdp with async saves), in one spawn: their newest checkpoints' paths, the CLI cases' run first."""
    rt = runtime(rank, world, "fsdp")
    T.train(make_cfg("fsdp", out, "run"), rt)
    paths = [os.path.join(out, "run", CKPT.format(TOTAL))]
    for strategy, extra in [("ddp", ()), ("zero3", ()), ("torch-ddp", ()), ("torch-fsdp", ()),
                            ("fsdp", ("checkpoint.async=true",))]:
        name = f"{strategy}{'-async' if extra else ''}"
        T.train(make_cfg(strategy, out, name, *extra, steps=1, every=1), runtime(rank, world, strategy))
        paths.append(os.path.join(out, name, CKPT.format(1)))
    return paths


@pytest.fixture(scope="module")
def every_engine(tmp_path_factory) -> list[str]:
    """The module's only spawn (2 ranks): the checkpoints of `_train_every_engine`."""
    return run_workers(2, _train_every_engine, str(tmp_path_factory.mktemp("trained")), timeout_s=240)[0]


@pytest.fixture(scope="module")
def trained(every_engine) -> str:
    """The CLI cases' run: fsdp on 2 ranks, checkpoints at K and TOTAL."""
    run = os.path.dirname(os.path.dirname(every_engine[0]))
    assert [s for s, _ in list_checkpoints(os.path.join(run, "checkpoints"))] == [K, TOTAL]
    assert sorted(os.listdir(os.path.join(run, CKPT.format(TOTAL)))) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "shardlab.json"]
    return run


def _command(kind: str, out: str, run: str) -> list[str]:
    if kind == "export":
        return ["export", run, "--out", os.path.join(out, "model.safetensors")]
    if kind == "eval":
        return ["eval", run]
    if kind == "generate":
        return ["generate", run, "--prompt", "def ", "--max-new-tokens", "4"]
    strategy, nproc = ("fsdp", ["--nproc", "2"]) if kind == "resume-2-workers" else ("single", [])
    return ["train", *overrides(strategy, out, "run", steps=TOTAL + 2), "checkpoint.resume=auto", *nproc]


TAMPERING = ("evil-metadata", "evil-metadata-rehashed", "bitflip")
COMMANDS = ("resume", "export", "eval", "generate")


@pytest.fixture(scope="module")
def tampered_runs(trained, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, str, subprocess.CompletedProcess]]:
    """Every (tampering, command) case on its own copy of the run, all commands in one driver
    (tests/cli_batch.py: a process per command, forked after torch was imported once); per case
    its directory (the copy under it, the marker, the export's output), the file tampered with
    and what the command did."""
    cases, commands = [], []
    for kind in TAMPERING:
        for command in COMMANDS:
            case = tmp_path_factory.mktemp(f"{kind}-{command}")
            run = shutil.copytree(trained, case / "run")
            changed = tamper(str(run / CKPT.format(TOTAL)), kind, str(case / "marker"))
            cases.append(((kind, command), (case, changed)))
            commands.append(Command(_command(command, str(case), str(run))))
    done = run_commands(commands, timeout_s=240)
    return {key: (*case, r) for (key, case), r in zip(cases, done)}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", TAMPERING)
def test_tampered_checkpoint_runs_no_code_and_fails_cleanly(tampered_runs, kind, command):
    case, changed, r = tampered_runs[kind, command]
    run = case / "run"
    ckpt = str(run / CKPT.format(TOTAL))

    assert not (case / "marker").exists(), "the checkpoint's pickle ran its command"
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: checkpoint "), r.stderr[-3000:]
    assert f"{ckpt}" in r.stderr
    if kind == "evil-metadata-rehashed":
        # the recorded hash matches: the unpickler is what refuses it
        assert f"{changed} refers to {os.system.__module__}.system" in r.stderr and "nothing was run" in r.stderr
    else:
        assert f"is corrupt or was modified: file {changed} has sha256 " in r.stderr
    # the way out names the previous checkpoint, which resume=auto did not fall back to silently
    assert f"resume from the previous complete checkpoint, {run / CKPT.format(K)}" in r.stderr
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [K, TOTAL]
    assert not os.path.exists(case / "model.safetensors")


def test_two_worker_resume_refuses_crafted_metadata(trained, tmp_path):
    """Under the launcher every rank verifies its share and all stop together: no traceback,
    no code run, the same error from each worker (in its stderr file), said once here."""
    run = shutil.copytree(trained, tmp_path / "run")
    marker = tmp_path / "marker"
    tamper(str(run / CKPT.format(TOTAL)), "evil-metadata-rehashed", str(marker))
    r = _shardlab(*_command("resume-2-workers", str(tmp_path), str(run)))
    assert not marker.exists()
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    refusals = [ln for ln in r.stderr.splitlines() if ln.startswith("error: checkpoint ") and "refers to" in ln]
    assert len(refusals) == 1, r.stderr[-3000:]
    launch = max((run / "debug" / "workers").iterdir(), key=lambda p: p.stat().st_mtime)  # this one, not training's
    logs = sorted(launch.glob("attempt_0/*/stderr.log"))
    assert [refusals[0] in p.read_text().splitlines() for p in logs] == [True, True]
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [K, TOTAL]


# ------------------------------------------------------------------------------ units, in process
def test_verification_names_unlisted_and_unrecorded_files(trained, tmp_path, caplog):
    ckpt = str(shutil.copytree(trained, tmp_path / "run") / CKPT.format(TOTAL))
    verify_checkpoint(ckpt, hashes=True)  # intact as written

    (tmp_path / "run" / CKPT.format(TOTAL) / "extra.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="corrupt or was modified: file extra.bin is not listed in shardlab.json"):
        read_model_state(ckpt)
    os.remove(os.path.join(ckpt, "extra.bin"))

    manifest_path = os.path.join(ckpt, "shardlab.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    (tmp_path / "run" / "checkpoints" / "outside").write_bytes(b"x")  # exists, right size: only the name is wrong
    with open(manifest_path, "w") as f:
        json.dump({**manifest, "files": {**manifest["files"], "../outside": 1}}, f)
    with pytest.raises(CheckpointError, match="shardlab.json lists '../outside', which is not a file of the checkpoint"):
        read_model_state(ckpt)

    del manifest["sha256"]["__0_0.distcp"]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match="records no sha256 for file __0_0.distcp"):
        read_tensors(ckpt, "model/")

    # a manifest from before hashes were recorded: still read (through the restricted
    # unpickler), with a warning that the content cannot be verified
    del manifest["sha256"]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with caplog.at_level(logging.WARNING, logger="shardlab.checkpoint"):
        state, _ = read_model_state(ckpt)
    assert "records no SHA-256" in caplog.text and state


def _write_metadata(ckpt: str, md) -> None:
    data = pickle.dumps(md)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(data)
    _rewrite_manifest(ckpt, ".metadata", data, rehash=True)


def test_metadata_made_of_allowed_classes_is_still_checked(trained, tmp_path):
    """A pickle needs no forbidden class to point DCP outside the checkpoint or at a pickled
    'bytes' entry (which DCP would read with torch.load(weights_only=False))."""
    ckpt = str(shutil.copytree(trained, tmp_path / "run") / CKPT.format(TOTAL))
    manifest = verify_checkpoint(ckpt, hashes=True)
    original = read_dcp_metadata(ckpt, manifest)

    md = read_dcp_metadata(ckpt, manifest)
    index = next(iter(md.storage_data))
    md.storage_data[index].relative_path = "../../elsewhere.distcp"
    _write_metadata(ckpt, md)
    with pytest.raises(CheckpointError, match=r"points entry .* at '../../elsewhere.distcp', not a data file listed"):
        read_model_state(ckpt)

    md = original
    md.state_dict_metadata["model/extra"] = BytesStorageMetadata()
    _write_metadata(ckpt, md)
    with pytest.raises(CheckpointError, match="refers to torch.distributed.checkpoint.metadata.BytesStorageMetadata"):
        read_model_state(ckpt)


class _RecordingUnpickler(pickle.Unpickler):
    def __init__(self, f, seen: set):
        super().__init__(f)
        self.seen = seen

    def find_class(self, module, name):
        self.seen.add(f"{module}.{name}")
        return super().find_class(module, name)


def test_restricted_unpickler_reads_what_every_engine_writes(every_engine, tmp_path):
    out = str(tmp_path)
    paths = list(every_engine)
    T.train(make_cfg("single", out, "single", steps=1, every=1), runtime(0, 1, "single"))
    paths.append(os.path.join(out, "single", CKPT.format(1)))
    seen: set[str] = set()
    for path in paths:
        manifest = verify_checkpoint(path, hashes=True)
        # the manifest hashes exactly the files there, as an independent hash of their bytes says
        names = sorted(n for n in os.listdir(path) if n != "shardlab.json")
        assert sorted(manifest["sha256"]) == sorted(manifest["files"]) == names, path
        for n in names:
            with open(os.path.join(path, n), "rb") as f:
                assert manifest["sha256"][n] == hashlib.sha256(f.read()).hexdigest(), (path, n)
        with open(os.path.join(path, ".metadata"), "rb") as f:
            trusted = _RecordingUnpickler(f, seen).load()  # written by this test, trusted
        safe = read_dcp_metadata(path, manifest)
        assert safe.state_dict_metadata == trusted.state_dict_metadata, path
        assert safe.storage_data == trusted.storage_data and safe.planner_data == trusted.planner_data, path
        assert any(isinstance(v.properties.dtype, torch.dtype) for v in safe.state_dict_metadata.values())
        assert read_tensors(path, "model/"), path
    # what the allowlist was derived from; a torch that pickles something new shows up here
    assert {"torch.distributed.checkpoint.metadata.Metadata", "torch.distributed.checkpoint.filesystem._StorageInfo",
            "torch.Size", "torch.float32"} <= seen, seen
