"""`shardlab bench`: bad arguments fail with a clear line before any run; the speed ratio
carries the rounds' spread and says when it is within noise; cells an engine cannot run are
skipped with their reason; every engine times its collectives per kind; an HSDP cell's traffic
and model state equal the theory columns (with S, not N). (The benchmark itself is run by hand
and recorded in docs/benchmarks.md; it is not a timed test.)"""

import json
import os
import subprocess
import sys

import pytest

from shardlab.bench_cells import plan_cells, waited_comm
from shardlab.bench_table import comm_bus_theory, speed_vs, summarize
from shardlab.testing import run_workers

# hang guards only, not speed budgets: the six cells of config_bench (each a `shardlab train`; each
# cell's own --timeout, 900 s, guards it) take about a minute idle, 154 s beside two CPU hogs, and went past a 300 s budget
# in CI at load 9-12. A spawn's guard is also its ranks' collective timeout, so a rank that raises
# keeps the other waiting that long: several minutes, not half an hour.
HANG_GUARD_S = 1200
SPAWN_HANG_GUARD_S = 600
pytestmark = pytest.mark.timeout(HANG_GUARD_S + 300)   # pytest-timeout (the suite's 300 s) above them


def _bench(*args: str) -> subprocess.CompletedProcess:
    """`shardlab bench ARGS`, its output captured; fails the test after HANG_GUARD_S (a hang guard)."""
    try:
        return subprocess.run([sys.executable, "-m", "shardlab", "bench", *args], capture_output=True, text=True,
                              timeout=HANG_GUARD_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"hang guard: shardlab bench still running after {HANG_GUARD_S} s: killed\n"
                             f"{(e.stdout or b'')[-2000:]!r}") from None


@pytest.mark.parametrize("args, fragment", [
    (["--nproc", "0"], "--nproc values must be >= 1"),
    (["--nproc", "two"], "comma-separated whole numbers"),
    (["--preset", "nope"], "unknown --preset 'nope'"),
    (["--strategies", "fsdp,nope"], "unknown strategies ['nope']"),
    (["--warmup", "5", "--steps", "5"], "--warmup must be"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--micro-batches", "0"], "--micro-batches must be >= 1"),
    (["--accumulate", "global"], "--accumulate takes comma-separated values from local, sharded"),
    (["--reshard-after-forward", "maybe"], "--reshard-after-forward takes comma-separated values"),
    (["--shard-size", "0,2"], "--shard-size takes comma-separated whole numbers >= 1"),
    (["--offload", "gpu"], "--offload takes comma-separated values from none, cpu"),
    (["--strategies", "ddp", "--offload", "cpu"], "every cell was skipped"),
    (["train.stpes=3"], "unknown config key 'train.stpes'"),
    (["--loss", "chunky"], "--loss takes comma-separated values from auto, chunked, full"),
    (["configs/resnet-cifar10.yaml", "data.source=synthetic", "--loss", "full,chunked"], "train.loss=chunked: model.name=resnet"),
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
    text = speed_vs(rows["torch-fsdp"], rows["fsdp"])
    assert text.startswith("0.98x") and "within noise" in text
    steady = {("fsdp", 2): [_metrics([0, 1.00]), _metrics([0, 1.01])],
              ("torch-fsdp", 2): [_metrics([0, 1.50]), _metrics([0, 1.49])]}
    rows = {r["strategy"]: r for r in summarize(steady, warmup=1)}
    text = speed_vs(rows["torch-fsdp"], rows["fsdp"])
    assert text.startswith("1.49x") and "within noise" not in text
    one = {("fsdp", 2): [_metrics([0, 1.0])], ("torch-fsdp", 2): [_metrics([0, 1.5])]}
    rows = {r["strategy"]: r for r in summarize(one, warmup=1)}
    assert "spread unknown" in speed_vs(rows["torch-fsdp"], rows["fsdp"])


def test_waited_comm_is_the_median_of_the_measured_steps_and_names_unseen_waits():
    """The table's "comm waited" column: per rank the median over the measured steps (counted
    from 1, as the flight record counts them), the largest rank shown; kinds DDP waits for in C++
    (out of the record's sight) named beside it; no flight records, said so."""
    from shardlab.bench_table import to_markdown

    per_rank = [[(1, 0.9, 1.0), (2, 0.2, 1.0), (3, 0.4, 1.0), (4, 0.3, 1.0)],
                [(1, 0.5, 1.0), (2, 0.1, 1.0), (3, 0.1, 1.0), (4, 0.1, 1.0)]]
    m = {**_metrics([0, 1.0, 1.0, 1.0]), "comm_waited": {"per_rank": per_rank, "unwaited": ["all_reduce"]}}
    (row,) = summarize({("torch-ddp", 2): [m]}, warmup=1)
    assert row["comm_waited_s_per_step"] == [0.3, 0.1] and row["comm_waited_s_per_step_max_rank"] == 0.3
    assert "| 300.0 (+ ar waited inside DDP: not seen) |" in to_markdown([row])
    (row,) = summarize({("fsdp", 2): [{**m, "comm_waited": None}]}, warmup=1)
    assert "| not recorded (no flight record: doctor.enabled=false) |" in to_markdown([row])


@pytest.fixture(scope="module")
def config_bench(tmp_path_factory):
    """One `shardlab bench` over a config (not a GPT preset) with overrides, two world sizes and
    the accumulate axis at k = 3 micro batches per rank: one cell per engine, world size and
    setting the engine takes (ddp, which has no shard, one cell per world size). Called in this
    process (`cli.main`): each cell is still its own `shardlab train`; the command's own process
    start is test_bench_hsdp_cell_matches_theory_and_reports_comm_time's."""
    from shardlab import cli

    tmp = tmp_path_factory.mktemp("config-bench")
    cfg = tmp / "mlp.yaml"
    cfg.write_text("model:\n  name: mlp\n  mlp_sizes: [16, 32, 4]\ndata:\n  source: synthetic\n"
                   "train:\n  optimizer: sgd\n  micro_batch_size: 4\n  global_batch_size: 8\n")
    rc = cli.main(["bench", str(cfg), "data.synthetic_samples=256", "--strategies", "ddp,fsdp", "--nproc", "1,2",
                   "--steps", "3", "--warmup", "1", "--micro-batches", str(ACCUMULATION), "--accumulate",
                   "local,sharded", "--out", str(tmp / "b")])
    assert rc == 0
    return tmp / "b"


ACCUMULATION = 3  # config_bench's micro batches per rank per step (k)


@pytest.mark.slow
def test_bench_runs_any_config_with_axes(config_bench):
    """A config with overrides, two world sizes and an axis only one engine takes: every cell ran
    and every figure comes from a run; the per-rank micro batch is the config's at every N."""
    rows = json.loads((config_bench / "bench.json").read_text())["rows"]
    cells = {(r["strategy"], r["world_size"], r["variant"]) for r in rows}
    assert cells == {("ddp", 1, ""), ("ddp", 2, ""),
                     *{("fsdp", n, f"accumulate={v}") for n in (1, 2) for v in ("local", "sharded")}}
    for r in rows:
        assert r["step_time_median_s"] > 0 and r["step_time_p90_s"] >= r["step_time_median_s"]
        assert r["model_state_theory_bytes"] == 8 * r["num_parameters"] / (r["world_size"] if r["sharded"] else 1)
    by = {(r["strategy"], r["world_size"], r["variant"]): r for r in rows}
    # weak scaling: the config's micro batch (4) per rank at every N, k micro batches of it per step
    for n in (1, 2):
        assert by[("ddp", n, "")]["samples_per_s"] > 0
        run_args = json.loads((config_bench / f"ddp-n{n}-r0" / "run_args.json").read_text())["config"]["train"]
        assert (run_args["micro_batch_size"], run_args["global_batch_size"]) == (4, 4 * n * ACCUMULATION)
    md = (config_bench / "bench.md").read_text()
    assert "config " in md and "accumulate=sharded" in md
    # another parallel.* axis the same way: ddp takes no reshard_after_forward, so it runs once
    order, skipped = plan_cells(["ddp", "fsdp"], [1, 2], [{"reshard_after_forward": v} for v in ("true", "false")])
    assert order == [(s, n, v) for n in (1, 2) for s, v in (("ddp", {}), ("fsdp", {"reshard_after_forward": "true"}),
                                                             ("fsdp", {"reshard_after_forward": "false"}))]
    assert not skipped


def test_invalid_cells_are_skipped_with_their_reason():
    variants = [{"shard_size": s, "offload": o} for s in ("1", "4") for o in ("none", "cpu")]
    order, skipped = plan_cells(["ddp", "fsdp", "zero3"], [2], variants)
    assert order == [("ddp", 2, {}),  # ddp takes neither axis: one cell, its only form
                     ("fsdp", 2, {"shard_size": "1", "offload": "none"}),
                     ("fsdp", 2, {"shard_size": "1", "offload": "cpu"}),
                     ("zero3", 2, {"offload": "none"}), ("zero3", 2, {"offload": "cpu"})]
    assert len(skipped) == 2, skipped
    assert skipped[0].startswith("ddp x2 offload=cpu: ddp has no offload")
    assert skipped[1].startswith("fsdp x2 shard_size=4: parallel.shard_size=4 must divide the world size 2")
    # --reduce-dtype reaches the engines inside their mixed-precision policy: those taking one vary,
    # torch-ddp (none) runs once
    order, skipped = plan_cells(["fsdp", "torch-ddp"], [2], [{"reduce_dtype": r} for r in ("bf16", "fp32")])
    assert order == [("fsdp", 2, {"reduce_dtype": "bf16"}), ("fsdp", 2, {"reduce_dtype": "fp32"}),
                     ("torch-ddp", 2, {})] and not skipped


def test_theory_uses_the_shard_group_size():
    psi = 1000
    assert comm_bus_theory("ddp", 4, 1, False, psi) == 2 * 3 / 4 * 4 * psi
    assert comm_bus_theory("fsdp", 4, 4, True, psi) == 3 * 3 / 4 * 4 * psi            # plain FSDP
    assert comm_bus_theory("fsdp", 4, 2, True, psi) == 3 / 2 * 4 * psi + 4 * psi / 2   # HSDP: RS/AG in 2, AR over 2
    assert comm_bus_theory("fsdp", 2, 1, True, psi) == comm_bus_theory("ddp", 2, 1, False, psi)  # S=1: DDP's
    m = {**_metrics([0, 1.0]), "num_parameters": 1000, "state_bytes_per_param": 16, "shard_size": 2}
    row = summarize({("fsdp", 4, "shard_size=2"): [m]}, warmup=1)[0]
    assert row["model_state_theory_bytes"] == 16 * 1000 / 2


# ------------------------------------------------------------------- per-collective time, every engine
def _timed_steps(rank: int, world: int) -> dict:
    """One AdamW step of the parity harness's small gpt with each engine: the calls and seconds
    each kind had in it. (ddp and plain fsdp time through the same collectives.py paths as fsdp
    with S = 1: async all-reduce, async reduce-scatter, blocking and async all-gather.)"""
    import torch

    import shardlab
    from tests.parity import GLOBAL_BATCH, batch, build

    out = {}
    for strategy, options in (("torch-ddp", {}), ("torch-fsdp", {}), ("zero3", {}), ("fsdp", {"shard_size": 1}),
                              ("torch-fsdp", {"shard_size": 1})):
        model = shardlab.parallelize(build("gpt", "meta", torch.float32), strategy, device="cpu", **options)
        engine = shardlab.engine_of(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        b = GLOBAL_BATCH // world
        calls, seconds = engine.comm_stats(), engine.comm_seconds()
        x, y = batch("gpt", 0, torch.float32)
        model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
        opt.step()
        after_calls, after_seconds = engine.comm_stats(), engine.comm_seconds()
        out[f"{strategy} {options}"] = {
            "calls": {k: v["calls"] - calls.get(k, {}).get("calls", 0) for k, v in after_calls.items()},
            "seconds": {k: v - seconds.get(k, 0.0) for k, v in after_seconds.items()}}
    return out


def test_every_engine_times_each_collective_kind():
    per_rank = run_workers(2, _timed_steps, timeout_s=SPAWN_HANG_GUARD_S)
    expected_kinds = {"torch-ddp {}": {"all_reduce"}, "torch-fsdp {}": {"all_gather", "reduce_scatter"},
                      "zero3 {}": {"broadcast", "reduce"},
                      "fsdp {'shard_size': 1}": {"all_gather", "reduce_scatter", "all_reduce"},
                      # FSDP2 at S = 1 neither gathers nor reduce-scatters (groups of one rank)
                      "torch-fsdp {'shard_size': 1}": {"all_reduce"}}
    for rank, res in enumerate(per_rank):
        for engine, kinds in expected_kinds.items():
            got = res[engine]
            with_calls = {k for k, n in got["calls"].items() if n}
            assert with_calls == kinds, (rank, engine, got)
            for k in with_calls:
                if engine == "torch-fsdp {'shard_size': 1}" and k == "all_reduce":
                    # FSDP2 issues no reduce-scatter at S = 1, so its HSDP all-reduce has no start mark:
                    # counted, not timed (engines/native.py)
                    assert got["seconds"].get(k, 0.0) == 0.0
                    continue
                assert got["seconds"][k] > 0, (rank, engine, k, got)
            # a kind without calls in the step has no time in it
            assert all(got["seconds"].get(k, 0.0) == 0.0 for k in got["seconds"] if k not in with_calls), got


def test_bench_hsdp_cell_matches_theory_and_reports_comm_time(tmp_path):
    """One real bench cell through `shardlab train`: fsdp at N = 2 with S = 1 (two replicas of one
    shard each); S = 4 is skipped with its reason. Traffic and model state equal the theory
    columns exactly (S = 1: no padding, the all-gathers and reduce-scatters send nothing);
    per-kind times are in bench.json and the table."""
    out = _bench("--strategies", "fsdp", "--nproc", "2", "--preset", "gpt-nano", "--seq-len", "16", "--micro-batch", "2",
                 "--steps", "3", "--warmup", "1", "--shard-size", "1,4", "--out", str(tmp_path / "b"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "skipped: fsdp x2 shard_size=4: parallel.shard_size=4 must divide the world size 2" in out.stdout
    result = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert len(result["skipped"]) == 1
    (row,) = result["rows"]
    assert (row["variant"], row["shard_size"]) == ("shard_size=1", 1)
    assert row["comm_bus_bytes_per_step"] == row["comm_bus_theory_bytes_per_step"] == 4 * row["num_parameters"]
    assert row["model_state_bytes_max_rank"] == row["model_state_theory_bytes"] == 16 * row["num_parameters"]
    kinds = set(row["comm_calls_per_step"])
    assert kinds == {"all_gather", "reduce_scatter", "all_reduce"}  # the wrap-time broadcast is not a step's
    for per_rank in row["comm_seconds_per_step"]:
        assert set(per_rank) == kinds and all(t > 0 for t in per_rank.values()), per_rank
    assert set(row["comm_seconds_per_step_max_rank"]) == kinds
    assert "collectives in flight ms / step" in out.stdout and "ar " in out.stdout
    # what each step waited on collectives, from the flight records: part of the step, never more
    waited = waited_comm(str(tmp_path / "b" / "fsdp-n2-sh1-r0"))
    assert waited["unwaited"] == [] and len(waited["per_rank"]) == 2
    for per_step in waited["per_rank"]:
        assert [step for step, _, _ in per_step] == [1, 2, 3]
        assert all(0 <= w <= total for _, w, total in per_step), per_step
    assert 0 < row["comm_waited_s_per_step_max_rank"] <= row["step_time_median_s"], row
    assert "comm waited ms / step (max rank)" in out.stdout


@pytest.mark.slow
def test_bench_sharded_accumulation_sends_k_times_the_reduce_scatter(config_bench):
    """fsdp at N = 2 with k = 3 micro batches per step, --accumulate local,sharded (config_bench's
    run): the counted (exact) reduce-scatter bytes per step under sharded are k times local's, the
    all-gathers the same; ddp, which has no shard, is one cell whatever the axis says."""
    order, _ = plan_cells(["ddp", "fsdp"], [2], [{"accumulate": "local"}, {"accumulate": "sharded"}])
    assert order == [("ddp", 2, {}), ("fsdp", 2, {"accumulate": "local"}), ("fsdp", 2, {"accumulate": "sharded"})]
    k = ACCUMULATION
    rows = {r["variant"]: r for r in json.loads((config_bench / "bench.json").read_text())["rows"]
            if (r["strategy"], r["world_size"]) == ("fsdp", 2)}
    local, sharded = (rows[f"accumulate={m}"]["comm_bus_bytes_per_step_by_kind"] for m in ("local", "sharded"))
    assert local["reduce_scatter"] > 0 and sharded["reduce_scatter"] == k * local["reduce_scatter"], (local, sharded)
    assert sharded["all_gather"] == local["all_gather"]
    assert rows["accumulate=sharded"]["comm_calls_per_step"]["reduce_scatter"] == \
        k * rows["accumulate=local"]["comm_calls_per_step"]["reduce_scatter"]
