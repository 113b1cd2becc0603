"""`shardlab bench`: bad arguments fail with a clear line before any run; the speed ratio
carries the rounds' spread and says when it is within noise. (The benchmark itself is run
by hand and recorded in docs/benchmarks.md; it is not a timed test.)"""

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
])
def test_bad_arguments_fail_cleanly(args, fragment, tmp_path):
    out = subprocess.run([sys.executable, "-m", "shardlab", "bench", *args, "--out", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert fragment in out.stderr and "Traceback" not in out.stderr
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
