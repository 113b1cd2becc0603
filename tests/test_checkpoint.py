"""Checkpoints in one process (strategy single): exact resume, atomicity, export, the errors
a corrupted or mismatched checkpoint gives, and the export/generate/eval commands."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import shardlab
from shardlab.checkpoint import (
    CheckpointError,
    CheckpointManager,
    list_checkpoints,
    read_model_state,
    resolve_checkpoint,
    verify_checkpoint,
)
from shardlab.cli import main as cli_main
from shardlab.export import export_checkpoint, load_exported
from shardlab.loop import run as R
from shardlab.loop import train as T
from shardlab.loop.schedule import make_optimizer, make_schedule
from shardlab.models import build_model
from tests.checkpoint_helpers import TOTAL, K, assert_same_tensors, make_cfg, runtime, straight_and_resumed

CKPT = "checkpoints/step_{:08d}"


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single"))
    return out, straight_and_resumed(0, 1, "single", out)


def test_exact_resume_single(single_runs):
    out, r = single_runs
    assert r["steps_this_run"] == TOTAL - K
    assert r["resumed"] == r["straight"] and len(r["straight"]) == TOTAL
    n = assert_same_tensors(f"{out}/single-straight/{CKPT.format(TOTAL)}", f"{out}/single-resumed/{CKPT.format(TOTAL)}")
    assert n > 50


def test_manifest_and_layout(single_runs):
    out, _ = single_runs
    path = f"{out}/single-straight/{CKPT.format(TOTAL)}"
    m = verify_checkpoint(path)
    assert m["step"] == TOTAL and m["strategy"] == "single" and m["world_size"] == 1
    assert m["optimizer"]["tensor_keys"] == ["exp_avg", "exp_avg_sq"] and m["optimizer"]["scalar_keys"] == ["step"]
    assert m["scheduler"]["last_epoch"] == TOTAL
    assert set(m["files"]) >= {".metadata", "shardlab.json"} or ".metadata" in m["files"]
    # tied head/embedding: one stored tensor, both state_dict names exported
    keys = m["state_dict_keys"]
    assert any(k != v for k, v in keys.items())
    assert not any(name.endswith(".tmp") for name in os.listdir(f"{out}/single-straight/checkpoints"))


def test_export_equals_full_state_dict(tmp_path):
    cfg = make_cfg("single", str(tmp_path), "run", steps=2, every=2)
    rt = runtime(0, 1, "single")
    model = shardlab.parallelize(build_model(cfg.model, seed=cfg.seed, vocab_size=256, device="meta"), "single",
                                 device="cpu")
    opt, state = make_optimizer(cfg.train, model.parameters()), R.TrainState()
    sched = make_schedule(cfg.train, opt)
    model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))).backward()
    opt.step()
    sched.step()
    state.step = 1
    mgr = CheckpointManager(str(tmp_path / "ck"), rt, config=cfg)
    path = mgr.save(model, opt, sched, state)
    out = str(tmp_path / "model.safetensors")
    export_checkpoint(path, out)
    exported, info = load_exported(out)
    full = shardlab.full_state_dict(model)
    assert exported.keys() == full.keys()
    for k in full:
        assert torch.equal(exported[k], full[k]), k
    assert info["model"]["kwargs"]["n_embd"] == 32 and info["step"] == 1


def test_torn_save_is_ignored_and_cleaned(single_runs, tmp_path):
    out, _ = single_runs
    root = str(tmp_path / "checkpoints")
    shutil.copytree(f"{out}/single-straight/checkpoints", root)
    good = list_checkpoints(root)
    assert [s for s, _ in good] == [K, TOTAL]
    # a save torn at any point: .tmp dir, manifest missing, a data file truncated
    shutil.copytree(good[-1][1], os.path.join(root, "step_00000009.tmp"))
    no_manifest = shutil.copytree(good[-1][1], os.path.join(root, "step_00000010"))
    os.remove(os.path.join(no_manifest, "shardlab.json"))
    truncated = shutil.copytree(good[-1][1], os.path.join(root, "step_00000011"))
    data = next(f for f in os.listdir(truncated) if f.endswith(".distcp"))
    with open(os.path.join(truncated, data), "r+b") as f:
        f.truncate(100)
    assert [s for s, _ in list_checkpoints(root)] == [K, TOTAL]
    assert resolve_checkpoint(root) == good[-1][1]
    with pytest.raises(CheckpointError, match="incomplete: no shardlab.json"):
        verify_checkpoint(no_manifest)
    with pytest.raises(CheckpointError, match="corrupted: __0_0.distcp has 100 bytes"):
        verify_checkpoint(truncated)
    with pytest.raises(CheckpointError, match="incomplete.*tmp"):
        resolve_checkpoint(os.path.join(root, "step_00000009.tmp"))


def test_a_checkpoint_pruned_while_listed_is_skipped(single_runs, tmp_path, monkeypatch):
    """A reader lists while the run prunes (retention): a directory that vanishes between the
    listing and its stat is skipped, not a FileNotFoundError (seen at load 20 in
    test_sigkill_worker_restarts_and_matches_uninterrupted's poll)."""
    out, _ = single_runs
    root = str(tmp_path / "checkpoints")
    shutil.copytree(f"{out}/single-straight/checkpoints", root)
    first = list_checkpoints(root)[0][1]
    real_getsize = os.path.getsize

    def pruned_meanwhile(path):
        if path.startswith(first + os.sep):
            shutil.rmtree(first, ignore_errors=True)
        return real_getsize(path)

    monkeypatch.setattr(os.path, "getsize", pruned_meanwhile)
    assert [s for s, _ in list_checkpoints(root)] == [TOTAL]


def _fresh(cfg):
    model = shardlab.parallelize(build_model(cfg.model, seed=cfg.seed, vocab_size=256, device="meta"),
                                 cfg.parallel.strategy, device="cpu")
    opt = make_optimizer(cfg.train, model.parameters())
    return model, opt, make_schedule(cfg.train, opt), R.TrainState()


def test_mismatched_checkpoint_errors(single_runs, tmp_path):
    out, _ = single_runs
    path = f"{out}/single-straight/{CKPT.format(TOTAL)}"
    rt = runtime(0, 1, "single")
    wider = make_cfg("single", str(tmp_path), "w", "model.n_embd=48")
    mgr = CheckpointManager(str(tmp_path / "ck"), rt, config=wider)
    with pytest.raises(CheckpointError, match=r"model shape mismatch: .*checkpoint \[.*32\] vs model \[.*48\]"):
        mgr.load(path, *_fresh(wider))
    deeper = make_cfg("single", str(tmp_path), "d", "model.n_layer=3")
    mgr = CheckpointManager(str(tmp_path / "ck2"), rt, config=deeper)
    with pytest.raises(CheckpointError, match=r"parameters missing from the checkpoint: \['blocks.2"):
        mgr.load(path, *_fresh(deeper))
    sgd = make_cfg("single", str(tmp_path), "s", "train.optimizer=sgd")
    mgr = CheckpointManager(str(tmp_path / "ck3"), rt, config=sgd)
    with pytest.raises(CheckpointError, match="holds AdamW state but the optimizer is SGD"):
        mgr.load(path, *_fresh(sgd))
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        mgr.load(str(tmp_path), *_fresh(sgd))


def test_keep_last_keeps_newest_complete(tmp_path):
    cfg = make_cfg("single", str(tmp_path), "keep", "checkpoint.keep_last=2", steps=5, every=1)
    T.train(cfg, runtime(0, 1, "single"))
    assert [s for s, _ in list_checkpoints(f"{tmp_path}/keep/checkpoints")] == [4, 5]
    assert sorted(os.listdir(f"{tmp_path}/keep/checkpoints")) == ["step_00000004", "step_00000005"]


def test_async_save_exact_resume(tmp_path):
    r = straight_and_resumed(0, 1, "single", str(tmp_path), "checkpoint.async=true")
    assert r["resumed"] == r["straight"]
    assert_same_tensors(f"{tmp_path}/single-straight/{CKPT.format(TOTAL)}",
                        f"{tmp_path}/single-resumed/{CKPT.format(TOTAL)}")


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    """NaN gradients at step 4 (a save step) make the parameters NaN before any loss shows it:
    the save refuses, the run stops naming the step, and step 2 stays the latest checkpoint."""
    cfg = make_cfg("single", str(tmp_path), "nan", steps=6, every=2)
    from shardlab.engines import engine_class

    engine = engine_class("single")  # train_step clips through the run's engine
    real_clip, calls = engine.clip_grad_norm_, {"n": 0}

    def clip_then_poison(self, max_norm, norm_type=2.0):
        norm = real_clip(self, max_norm, norm_type)
        calls["n"] += 1
        if calls["n"] == 4:
            for p in self.local_parameters():
                p.grad.fill_(float("nan"))
        return norm

    monkeypatch.setattr(engine, "clip_grad_norm_", clip_then_poison)
    with pytest.raises(FloatingPointError, match="non-finite parameters at step 4.*last good checkpoint is step 2"):
        T.train(cfg, runtime(0, 1, "single"))
    assert [s for s, _ in list_checkpoints(f"{tmp_path}/nan/checkpoints")] == [2]
    state, _ = read_model_state(resolve_checkpoint(f"{tmp_path}/nan"))
    assert all(torch.isfinite(v).all() for v in state.values())


def test_export_generate_eval_commands(single_runs, tmp_path, capsys):
    out, _ = single_runs
    run = f"{out}/single-straight"
    model_file = str(tmp_path / "m.safetensors")
    assert cli_main(["export", run, "--step", str(K), "--out", model_file]) == 0
    _, info = load_exported(model_file)
    assert info["step"] == K
    capsys.readouterr()
    assert cli_main(["generate", model_file, "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert cli_main(["eval", model_file]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert cli_main(["eval", run, "--step", str(K)]) == 0
    from_run = json.loads(capsys.readouterr().out)
    assert from_file["val_loss"] == from_run["val_loss"] and from_file["val_loss"] > 0
    assert cli_main(["export", run, "--step", "99", "--out", model_file]) == 1
    assert "no complete checkpoint of step 99" in capsys.readouterr().err
