"""The documented command end to end: `shardlab train CONFIG --nproc 2` for PyTorch's engines,
metrics.json / run_args.json contents, determinism, and a single-process run."""

import json
import math
import shutil
import subprocess
import sys

import pytest

from shardlab.checkpoint import step_dir_name

METRIC_KEYS = {"wall_clock_s", "steps", "samples_processed", "tokens_processed", "samples_per_s", "tokens_per_s",
               "step_time_median_s", "world_size", "strategy", "device", "peak_memory_bytes", "final_loss", "losses"}


def _train(tmp_path, name, *args, nproc=2, timeout=240, progress=False):
    """`shardlab train` as a user runs it: a subprocess (with --nproc N, the launcher and its workers)."""
    cmd = [sys.executable, "-m", "shardlab", "train", "configs/gpt-tiny.yaml", *args,
           f"output.dir={tmp_path}", f"output.run_name={name}", f"output.progress={str(progress).lower()}"]
    if nproc:
        cmd += ["--nproc", str(nproc)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return (*_records(tmp_path / name), out)


def _train_here(tmp_path, name, *args):
    """`shardlab train` without --nproc (one process) through the CLI's `main`, in this process: the
    same command line and code path as a subprocess, without paying ~3 CPU-s to import torch again.
    For what the run computes and writes; the launcher and the console are tested by the subprocesses."""
    from shardlab.cli import main

    assert main(["train", "configs/gpt-tiny.yaml", *args, f"output.dir={tmp_path}", f"output.run_name={name}",
                 "output.progress=false"]) == 0
    return _records(tmp_path / name)


def _records(run):
    return json.loads((run / "metrics.json").read_text()), json.loads((run / "run_args.json").read_text())


# One 2-worker torch-ddp run serves the report test and the determinism test (a second identical run
# and one process beside it): 12 steps with clipping engaged (grad_clip=0.5), equal to one process to
# ~1e-7 relative over all 12 steps (measured 2026-11-28), within the 1e-5 the test allows.
COMMON = ["model.preset=gpt-nano", "data.seq_len=64", "train.steps=12", "train.lr=3e-3", "train.grad_clip=0.5"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ddp"), "torch-ddp", "parallel.strategy=torch-ddp", *COMMON)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["torch-ddp", "torch-fsdp"])
def test_two_worker_run_learns_and_reports(tmp_path, strategy, request):
    steps = 12
    if strategy == "torch-ddp":
        m, args, out = request.getfixturevalue("ddp_run")
    else:
        m, args, out = _train(tmp_path, strategy, f"parallel.strategy={strategy}", *COMMON)
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
    # each rank's process CPU seconds a step, aligned with the steps' wall times (plan/cpu.py reads them)
    assert [len(c) for c in m["cpu_seconds_per_step"]] == [steps, steps]
    assert all(0 < c for rank in m["cpu_seconds_per_step"] for c in rank)
    assert args["world_size"] == 2 and len(args["hostnames"]) == 2
    assert args["config"]["parallel"]["strategy"] == strategy
    assert args["torch_version"] and args["shardlab_version"]
    assert "run directory:" in out.stdout and "samples/s" in out.stdout  # the summary table


@pytest.mark.slow
def test_same_seed_same_loss_curve_and_single_process(tmp_path, ddp_run, spawned_runs):
    """Determinism (the same config trained again: here in the module's 2-rank spawn, through the
    loop the CLI's workers run, bitwise the CLI run's curve), and a 2-worker torch-ddp run equals one
    process on the same global batches, clipping included."""
    a = ddp_run[0]
    b = spawned_runs["torch-ddp-again"]
    s, _ = _train_here(tmp_path, "s", "parallel.strategy=single", *COMMON)
    assert a["losses"] == b
    assert s["world_size"] == 1 and len(s["losses"]) == len(a["losses"]) == 12
    for x, y in zip(a["losses"], s["losses"]):
        assert x == pytest.approx(y, rel=1e-5)


def test_loop_options_single_process(tmp_path):
    """bf16 autocast, activation checkpointing, periodic evaluation and TensorBoard, in one short run."""
    m, args = _train_here(tmp_path, "opts", "parallel.strategy=single", "model.preset=gpt-nano", "data.seq_len=32",
                          "train.steps=4", "train.precision=bf16", "train.activation_checkpointing=true",
                          "train.eval_every=2", "train.eval_batches=1", "train.optimizer=sgd", "train.lr=0.05")
    assert m["steps"] == 4 and all(math.isfinite(x) for x in m["losses"])
    assert set(m["val_losses"]) == {"2", "4"} and all(math.isfinite(v) for v in m["val_losses"].values())
    events = list((tmp_path / "opts" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert args["config"]["train"]["precision"] == "bf16"


def test_activation_checkpointing_does_not_change_the_math(tmp_path):
    common = ["parallel.strategy=single", "model.preset=gpt-nano", "data.seq_len=32", "train.steps=3"]
    plain, _ = _train_here(tmp_path, "plain", *common)
    ckpt, _ = _train_here(tmp_path, "ckpt", *common, "train.activation_checkpointing=true")
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6)


REDUCE_KIND = {"ddp": "all_reduce", "zero3": "reduce", "fsdp": "reduce_scatter",
               "torch-ddp": "all_reduce", "torch-fsdp": "reduce_scatter"}


ACCUMULATION_COMMON = ["model.preset=gpt-nano", "data.seq_len=32", "train.steps=3", "train.global_batch_size=16",
                       "output.tensorboard=false", "train.optimizer=sgd", "train.lr=0.1"]


def _spawned_runs(rank: int, world: int, out_dir: str) -> dict:
    """The module's 2-rank runs, in one spawn (`shardlab.loop.train.train`, the CLI's code path minus
    the launcher: one process start-up instead of eleven): every engine at accumulation 1 and 4, and
    the determinism test's second torch-ddp run."""
    import torch

    from shardlab.config import load_config
    from shardlab.loop.runtime import Runtime
    from shardlab.loop.train import train

    again = load_config("configs/gpt-tiny.yaml", ["parallel.strategy=torch-ddp", *COMMON, f"output.dir={out_dir}",
                                                  "output.run_name=torch-ddp-again", "output.progress=false"])
    return {"accumulation": _accumulation_runs(rank, world, out_dir),
            "torch-ddp-again": train(again, Runtime(rank, rank, world, torch.device("cpu"), "gloo"))["losses"]}


@pytest.fixture(scope="module")
def spawned_runs(tmp_path_factory):
    from shardlab.testing import run_workers

    return run_workers(2, _spawned_runs, str(tmp_path_factory.mktemp("spawned")), timeout_s=280)[0]


def _accumulation_runs(rank: int, world: int, out_dir: str) -> dict:
    """Every engine at accumulation 1 and 4, trained in turn."""
    import torch

    from shardlab.config import load_config
    from shardlab.loop.runtime import Runtime
    from shardlab.loop.train import train

    out = {}
    for strategy, kind in REDUCE_KIND.items():
        for mb in (8, 2):  # accumulation 1 and 4 on 2 ranks
            name = f"{strategy}-{mb}"
            cfg = load_config("configs/gpt-tiny.yaml", [f"parallel.strategy={strategy}", f"train.micro_batch_size={mb}",
                                                        *ACCUMULATION_COMMON, f"output.dir={out_dir}",
                                                        f"output.run_name={name}",
                                                        "output.progress=false"])
            result = train(cfg, Runtime(rank, rank, world, torch.device("cpu"), "gloo"))
            with open(f"{out_dir}/{name}/run_args.json") as f:
                accumulation = json.load(f)["accumulation_steps"]
            out[name] = {"losses": result["losses"], "accumulation": accumulation,
                         "calls": [r[kind]["calls"] for r in result["comm_bytes"]]}
    return out


@pytest.mark.slow
def test_accumulation_communicates_once_per_step(tmp_path, spawned_runs):
    """With 4 micro batches per rank, the gradient reductions are those of 1 micro batch: the
    first three backward passes run inside no_sync and send nothing. PyTorch's engines are
    counted through DDP's communication hook and FSDP2's custom collectives (engines/native.py)."""
    single, _ = _train_here(tmp_path, "single", "parallel.strategy=single", "train.micro_batch_size=16",
                            *ACCUMULATION_COMMON)
    runs = spawned_runs["accumulation"]
    for strategy, kind in REDUCE_KIND.items():
        for mb in (8, 2):
            run = runs[f"{strategy}-{mb}"]
            assert run["accumulation"] == 8 // mb
            # float32 on 2 CPU ranks: reduction order differs from one process by ~1e-7 relative
            assert run["losses"] == pytest.approx(single["losses"], rel=1e-5), (strategy, mb)
        calls = {mb: runs[f"{strategy}-{mb}"]["calls"] for mb in (8, 2)}
        assert calls[2] == calls[8] and calls[8][0] > 0, f"{strategy}: {kind} calls {calls}"


@pytest.mark.slow
def test_a_finished_run_started_again_trains_and_rewrites_nothing(tmp_path):
    """A run started again once it reached its last step (the same command, here at another
    --nproc) trains nothing, says so in one line before any worker starts, exits 0 and leaves the
    records of the attempt that trained as they were; one that trains on adds its attempt to
    metrics.json's `attempts` ([Note: records stay true]). The first run's output is piped: progress
    lines, no bar frames, no notice of lines on the workers' stderr. (The launcher's part, deciding
    before a worker starts, is the second command's; the run that trains on is one process.)"""
    common = ["parallel.strategy=ddp", "model.preset=gpt-nano", "data.seq_len=32", "train.steps=3",
              "checkpoint.every_steps=3", "output.tensorboard=false"]
    first, _, out = _train(tmp_path, "run", *common, progress=True)
    assert "ddp x2  step 3/3  loss " in out.stdout and "%|" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert "more line(s)" not in out.stderr and "\nshardlab: checkpoint step 3:" in out.stdout
    assert first["world_size"] == 2 and first["steps_this_run"] == 3
    assert [(a["world_size"], a["steps_from"], a["steps_to"]) for a in first["attempts"]] == [(2, 0, 3)]
    assert first["attempts"][0]["train_s"] == pytest.approx(sum(first["step_times_s"]))
    run = tmp_path / "run"
    kept = {name: (run / name).read_bytes() for name in ("metrics.json", "run_args.json", "steps.jsonl")}
    launches = sorted((run / "debug" / "workers").iterdir())
    _, _, out = _train(tmp_path, "run", *common, "checkpoint.resume=auto", nproc=1)
    assert out.stdout.strip() == (f"shardlab: the run finished at step 3 (train.steps=3): nothing to do; its records "
                                  f"are kept ({run}/metrics.json); a higher train.steps trains on, --fresh starts "
                                  "over beside it"), out.stdout
    assert {name: (run / name).read_bytes() for name in kept} == kept
    assert sorted((run / "debug" / "workers").iterdir()) == launches  # no worker started
    longer, args = _train_here(tmp_path, "run", *common, "train.steps=5")  # one process, in this one
    assert args["resumed_from_step"] == 3 and args["world_size"] == 1
    assert longer["world_size"] == 1 and longer["steps"] == 5 and longer["steps_this_run"] == 2
    assert longer["losses"][:3] == first["losses"]
    assert [(a["world_size"], a["steps_from"], a["steps_to"]) for a in longer["attempts"]] == [(2, 0, 3), (1, 3, 5)]
    assert longer["attempts"][0]["launch"] != longer["attempts"][1]["launch"]


def test_fp16_run_reports_scale_and_resumes_exactly(tmp_path):
    """fp16 autocast with dynamic loss scaling through the CLI. growth_interval=1 moves the
    scale every step, so a resume that lost the scaler's state would not be bitwise exact."""
    common = ["parallel.strategy=single", "model.preset=gpt-nano", "data.seq_len=32", "train.steps=4",
              "train.precision=fp16", "train.loss_scale_growth_interval=1", "checkpoint.every_steps=2",
              "output.tensorboard=false", "model.dropout=0.1"]
    straight, _ = _train_here(tmp_path, "straight", *common)
    assert straight["loss_scale"] > 0 and straight["skipped_steps"] >= 0
    assert all(math.isfinite(x) for x in straight["losses"])
    # The interrupted run: the straight run's directory without its step-4 checkpoint (the LR
    # schedule depends on train.steps, so a shorter run would not be the same run).
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / step_dir_name(4))
    resumed, args = _train_here(tmp_path, "resumed", *common, "checkpoint.resume=auto")
    assert args["resumed_from_step"] == 2 and resumed["steps_this_run"] == 2
    assert resumed["losses"] == straight["losses"]
    assert resumed["loss_scale"] == straight["loss_scale"]
    assert resumed["skipped_steps"] == straight["skipped_steps"]


def test_same_command_resumes_with_the_default_run_name(tmp_path, capsys):
    """docs/preemption.md: re-running the same command continues the run. The default run name is
    a function of the config, so it does; a higher train.steps continues it too, with the
    schedule it started with (said on the console), and `shardlab train RUN_DIR/config.yaml`
    is the same run."""
    from shardlab.checkpoint import read_manifest
    from shardlab.cli import main

    args = ["train", "configs/gpt-tiny.yaml", "parallel.strategy=single", "model.preset=gpt-nano", "data.seq_len=32",
            "train.steps=2", "train.warmup_steps=0", "train.lr=0.01", "checkpoint.every_steps=1",
            f"output.dir={tmp_path}", "output.progress=false", "output.tensorboard=false", "train.memory_tracking=none"]
    assert main(args) == 0
    (run,) = tmp_path.iterdir()
    assert run.name.startswith("gpt-single-") and "resumed" not in capsys.readouterr().out
    assert main(args) == 0  # the same command: the run had finished
    out = capsys.readouterr().out
    assert out.startswith("shardlab: the run finished at step 2 (train.steps=2): nothing to do") and "resumed" not in out
    assert main([*args, "train.steps=4"]) == 0  # train longer: the same run
    out = capsys.readouterr().out
    assert f"resumed from step 2 of {run}" in out
    assert "note: train.steps=4 (the run's schedule: 2): the learning-rate schedule is kept" in out
    assert list(tmp_path.iterdir()) == [run]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 4 and len(metrics["losses"]) == 4 and metrics["steps_this_run"] == 2
    # step 3 trained at the floor of the 2-step schedule (lr x min_lr_ratio), not a re-stretched
    # cosine's 0.23 x lr; the schedule itself is in the checkpoint
    sched = read_manifest(str(run / "checkpoints" / step_dir_name(3)))["scheduler"]
    assert sched["_last_lr"] == [pytest.approx(0.01 * 0.1)] and sched["lr_lambdas"][0]["steps"] == 2
    assert metrics["num_trainable_parameters"] == metrics["num_parameters"] > 0
    assert main(["train", str(run / "config.yaml"), "train.steps=5"]) == 0
    assert f"resumed from step 4 of {run}" in capsys.readouterr().out


def test_default_run_name_ignores_how_a_run_is_watched():
    from shardlab.config import load_config
    from shardlab.loop.train import default_run_name

    base = ["model.preset=gpt-nano", "data.seq_len=32"]
    name = default_run_name(load_config("configs/gpt-tiny.yaml", base))
    for same in ("train.steps=99", "output.progress=false", "checkpoint.every_steps=5", "train.eval_every=3"):
        assert default_run_name(load_config("configs/gpt-tiny.yaml", [*base, same])) == name, same
    for other in ("train.lr=0.5", "seed=1", "data.seq_len=64", "parallel.strategy=ddp"):
        assert default_run_name(load_config("configs/gpt-tiny.yaml", [*base, other])) != name, other


def test_a_finished_run_keeps_its_last_step_for_export(tmp_path, capsys):
    """checkpoint.final (default true): with no periodic checkpoints a finished run still saves its
    last step, so `shardlab export` works afterwards; checkpoint.final=false keeps nothing."""
    from shardlab.checkpoint import read_manifest
    from shardlab.cli import main

    common = ["train", "configs/gpt-tiny.yaml", "parallel.strategy=single", "model.preset=gpt-nano",
              "data.seq_len=32", "train.steps=2", f"output.dir={tmp_path}", "output.progress=false",
              "output.tensorboard=false", "train.memory_tracking=none"]
    assert main([*common, "output.run_name=default"]) == 0
    (step,) = (tmp_path / "default" / "checkpoints").iterdir()
    assert read_manifest(str(step))["step"] == 2
    assert main(["export", str(tmp_path / "default"), "--out", str(tmp_path / "model.safetensors")]) == 0
    assert (tmp_path / "model.safetensors").stat().st_size > 0
    assert main([*common, "output.run_name=kept-nothing", "checkpoint.final=false"]) == 0
    assert not (tmp_path / "kept-nothing" / "checkpoints").exists()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "kept-nothing"), "--out", str(tmp_path / "none.safetensors")]) == 1
    assert "no complete checkpoint under" in capsys.readouterr().err
