"""`shardlab bench`: bad arguments fail with a clear line before any run; the speed ratio
carries the rounds' spread and says when it is within noise. (The benchmark itself is run
by hand and recorded in docs/benchmarks.md; it is not a timed test.)"""

import json
import os
import subprocess
import sys

import pytest

from shardlab.bench import _speed_vs, summarize


@pytest.mark.parametrize("args, fragment", [
    (["--nproc", "0"], "--nproc values must be >= 1"),
    (["--nproc", "two"], "comma-separated whole numbers"),
    (["--preset", "nope"], "unknown --preset 'nope'"),
    (["--strategies", "fsdp,nope"], "unknown strategies ['nope']"),
    (["--warmup", "5", "--steps", "5"], "--warmup must be"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--reshard-after-forward", "maybe"], "--reshard-after-forward takes comma-separated values"),
    (["train.stpes=3"], "unknown config key 'train.stpes'"),
])
def test_bad_arguments_fail_cleanly(args, fragment, tmp_path, capsys):
    from shardlab import cli

    assert cli.main(["bench", *args, "--out", str(tmp_path / "b")]) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # nothing ran


def _metrics(step_times: list[float]) -> dict:
    return {"step_times_s": step_times, "num_parameters": 10, "sharded": True, "samples_processed": 8 * len(step_times),
            "steps_this_run": len(step_times), "model_state_bytes": [1], "comm_bytes": [None],
            "peak_memory_bytes": [1], "final_loss": 1.0}


def test_speed_ratio_within_the_rounds_spread_says_so():
    cells = {("fsdp", 2): [_metrics([0, 1.00, 1.00]), _metrics([0, 1.20, 1.20])],   # rounds disagree by 18%
             ("torch-fsdp", 2): [_metrics([0, 1.05, 1.05]), _metrics([0, 1.10, 1.10])]}
    rows = {r["strategy"]: r for r in summarize(cells, warmup=1)}
    assert rows["fsdp"]["round_medians_s"] == [1.0, 1.2]
    text = _speed_vs(rows["torch-fsdp"], rows["fsdp"])
    assert text.startswith("0.98x") and "within noise" in text
    steady = {("fsdp", 2): [_metrics([0, 1.00]), _metrics([0, 1.01])],
              ("torch-fsdp", 2): [_metrics([0, 1.50]), _metrics([0, 1.49])]}
    rows = {r["strategy"]: r for r in summarize(steady, warmup=1)}
    text = _speed_vs(rows["torch-fsdp"], rows["fsdp"])
    assert text.startswith("1.49x") and "within noise" not in text
    one = {("fsdp", 2): [_metrics([0, 1.0])], ("torch-fsdp", 2): [_metrics([0, 1.5])]}
    rows = {r["strategy"]: r for r in summarize(one, warmup=1)}
    assert "spread unknown" in _speed_vs(rows["torch-fsdp"], rows["fsdp"])


@pytest.mark.slow
def test_bench_runs_any_config_with_axes(tmp_path):
    """A config (not a GPT preset) with overrides, two world sizes and the reshard axis: one
    cell per engine, world size and setting the engine takes; every figure comes from a run."""
    cfg = tmp_path / "mlp.yaml"
    cfg.write_text("model:\n  name: mlp\n  mlp_sizes: [16, 32, 4]\ndata:\n  source: synthetic\n"
                   "train:\n  optimizer: sgd\n  micro_batch_size: 4\n  global_batch_size: 8\n")
    out = subprocess.run([sys.executable, "-m", "shardlab", "bench", str(cfg), "data.synthetic_samples=256",
                          "--strategies", "ddp,fsdp", "--nproc", "1,2", "--steps", "3", "--warmup", "1",
                          "--reshard-after-forward", "true,false", "--out", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "b" / "bench.json").read_text())["rows"]
    cells = {(r["strategy"], r["world_size"], r["variant"]) for r in rows}
    assert cells == {("ddp", 1, ""), ("ddp", 2, ""),
                     *{("fsdp", n, f"reshard_after_forward={v}") for n in (1, 2) for v in ("true", "false")}}
    for r in rows:
        assert r["step_time_median_s"] > 0 and r["step_time_p90_s"] >= r["step_time_median_s"]
        assert r["model_state_theory_bytes"] == 8 * r["num_parameters"] / (r["world_size"] if r["sharded"] else 1)
    by = {(r["strategy"], r["world_size"], r["variant"]): r for r in rows}
    # weak scaling: the config's micro batch (4) per rank at every N
    assert by[("ddp", 2, "")]["samples_per_s"] > 0
    md = (tmp_path / "b" / "bench.md").read_text()
    assert "config " in md and "reshard_after_forward=false" in md
