"""The documented command end to end: `shardlab train CONFIG --nproc 2` for PyTorch's engines,
metrics.json / run_args.json contents, determinism, and a single-process run."""

import json
import math
import subprocess
import sys

import pytest

METRIC_KEYS = {"wall_clock_s", "steps", "samples_processed", "tokens_processed", "samples_per_s", "tokens_per_s",
               "step_time_median_s", "world_size", "strategy", "device", "peak_memory_bytes", "final_loss", "losses"}


def _train(tmp_path, name, *args, nproc=2, timeout=240):
    cmd = [sys.executable, "-m", "shardlab", "train", "configs/gpt-tiny.yaml", *args,
           f"output.dir={tmp_path}", f"output.run_name={name}", "output.progress=false"]
    if nproc:
        cmd += ["--nproc", str(nproc)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / name
    return json.loads((run / "metrics.json").read_text()), json.loads((run / "run_args.json").read_text()), out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["torch-ddp", "torch-fsdp"])
def test_two_worker_run_learns_and_reports(tmp_path, strategy):
    steps = 12
    m, args, out = _train(tmp_path, strategy, f"parallel.strategy={strategy}", f"train.steps={steps}",
                          "model.preset=gpt-nano", "data.seq_len=64", "train.lr=3e-3")
    assert METRIC_KEYS <= set(m)
    assert m["world_size"] == 2 and m["strategy"] == strategy and m["device"] == "cpu"
    assert m["steps"] == steps and len(m["losses"]) == steps
    assert m["samples_processed"] == steps * 16 and m["tokens_processed"] == steps * 16 * 64
    assert all(math.isfinite(x) for x in m["losses"])
    assert sum(m["losses"][-3:]) / 3 < m["losses"][0] - 0.5  # it learns (from ~ln 256 = 5.5)
    assert m["final_loss"] == m["losses"][-1]
    assert len(m["peak_memory_bytes"]) == 2 and all(2**20 < b < 8 * 2**30 for b in m["peak_memory_bytes"])
    assert m["samples_per_s"] > 0 and m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 64)
    assert 0 < m["step_time_median_s"] < m["wall_clock_s"]
    assert args["world_size"] == 2 and len(args["hostnames"]) == 2
    assert args["config"]["parallel"]["strategy"] == strategy
    assert args["torch_version"] and args["shardlab_version"]
    assert "run directory:" in out.stdout and "samples/s" in out.stdout  # the summary table


@pytest.mark.slow
def test_same_seed_same_loss_curve_and_single_process(tmp_path):
    """Determinism, and a 2-worker torch-ddp run equals one process on the same global batches."""
    common = ["model.preset=gpt-nano", "data.seq_len=64", "train.steps=5", "train.grad_clip=0.5"]
    a, _, _ = _train(tmp_path, "a", "parallel.strategy=torch-ddp", *common)
    b, _, _ = _train(tmp_path, "b", "parallel.strategy=torch-ddp", *common)
    s, _, _ = _train(tmp_path, "s", "parallel.strategy=single", *common, nproc=None)
    assert a["losses"] == b["losses"]
    assert s["world_size"] == 1
    for x, y in zip(a["losses"], s["losses"]):
        assert x == pytest.approx(y, rel=1e-5)


def test_loop_options_single_process(tmp_path):
    """bf16 autocast, activation checkpointing, periodic evaluation and TensorBoard, in one short run."""
    m, args, _ = _train(tmp_path, "opts", "parallel.strategy=single", "model.preset=gpt-nano", "data.seq_len=32",
                        "train.steps=4", "train.precision=bf16", "train.activation_checkpointing=true",
                        "train.eval_every=2", "train.eval_batches=1", "train.optimizer=sgd", "train.lr=0.05",
                        nproc=None)
    assert m["steps"] == 4 and all(math.isfinite(x) for x in m["losses"])
    assert set(m["val_losses"]) == {"2", "4"} and all(math.isfinite(v) for v in m["val_losses"].values())
    events = list((tmp_path / "opts" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert args["config"]["train"]["precision"] == "bf16"


def test_activation_checkpointing_does_not_change_the_math(tmp_path):
    common = ["parallel.strategy=single", "model.preset=gpt-nano", "data.seq_len=32", "train.steps=3"]
    plain, _, _ = _train(tmp_path, "plain", *common, nproc=None)
    ckpt, _, _ = _train(tmp_path, "ckpt", *common, "train.activation_checkpointing=true", nproc=None)
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6)
