"""Checkpoints across processes: exact resume for every engine, resharding 4->2, 4->3 and
across engines, every engine resumed at 4 -> 2 -> 3 ranks equal to an uninterrupted run
(tests/elastic_cases.py), a save torn by a killed rank, and a real SIGKILL under the elastic agent
(whose restarted run `shardlab report` and `shardlab trace` read back too).

One spawn per world size (process start-up dominates on small machines); each spawn runs
all of its cases and returns what the parent then checks.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from shardlab.checkpoint import list_checkpoints, read_tensors
from shardlab.config import load_config
from shardlab.loop import train as T
from shardlab.observe.report import build_report
from shardlab.observe.runs import read_run
from shardlab.observe.trace import build_trace
from shardlab.testing import WorkerError, run_workers
from tests import elastic_cases
from tests.checkpoint_helpers import (
    TOTAL,
    K,
    assert_same_tensors,
    load_and_resave,
    make_cfg,
    runtime,
    straight_and_resumed,
)
from tests.test_observe import nested

# hang guards only, not speed budgets: the killed 40-step 2-rank run takes less than the 30 s a
# 100-step one took idle, and its two restarts each start two workers again; at load 10 on 2 cores
# that is minutes.
# A spawn's guard is also its ranks' collective timeout: several minutes, not more.
HANG_GUARD_S = 600
SPAWN_HANG_GUARD_S = 300

pytestmark = pytest.mark.slow

ENGINES = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")
# Runs compared across world sizes: no dropout (each world size draws other masks), and a
# micro batch of 1 so that the global batch of 12 divides over 2, 3 and 4 ranks.
NO_DROPOUT = "model.dropout=0.0"
MICRO1 = "train.micro_batch_size=1"


def step_path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:08d}")


# ---------------------------------------------------------------------------------- world size 4
def _four(rank: int, world: int, out: str, corpus: str) -> list[float]:
    losses = T.train(make_cfg("fsdp", out, "fsdp4", NO_DROPOUT, MICRO1), runtime(rank, world, "fsdp"))["losses"]
    elastic_cases.phase(rank, world, out, corpus)
    return losses


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("four"))
    corpus = elastic_cases.prepare_corpus(tmp_path_factory.mktemp("corpus"))
    losses = run_workers(4, _four, out, corpus, timeout_s=240)[0]
    return {"out": out, "run": os.path.join(out, "fsdp4"), "losses": losses, "corpus": corpus}


def _continue_from(rank: int, world: int, strategy: str, source: str, out: str, name: str) -> list[float]:
    cfg = make_cfg(strategy, out, name, NO_DROPOUT, MICRO1, f"checkpoint.resume={source}")
    return T.train(cfg, runtime(rank, world, strategy))["losses"]


def _check_continuation(four: dict, out: str, name: str, losses: list[float]) -> None:
    """Same parameters and optimizer state continue the same training (up to float reordering)."""
    assert losses[:K] == four["losses"][:K]  # restored from the manifest
    assert torch.allclose(torch.tensor(losses[K:]), torch.tensor(four["losses"][K:]), rtol=1e-5, atol=1e-6)
    mine = read_tensors(step_path(os.path.join(out, name), TOTAL), "model/")
    ref = read_tensors(step_path(four["run"], TOTAL), "model/")
    for k in ref:
        assert torch.allclose(mine[k], ref[k], atol=2e-5), k


# ---------------------------------------------------------------------------------- world size 2
def _two(rank: int, world: int, out: str, four_ckpt: str, elastic: tuple[str, str]) -> dict:
    res: dict = {"timing": {}}
    elastic_cases.phase(rank, world, *elastic)
    for strategy in ENGINES:
        t0 = time.perf_counter()
        res[strategy] = straight_and_resumed(rank, world, strategy, out)
        res["timing"][strategy] = time.perf_counter() - t0
    res["fsdp-async"] = straight_and_resumed(rank, world, "fsdp", out, "checkpoint.async=true", tag="-async")
    t0 = time.perf_counter()
    res["pairs"] = {}
    for src in ENGINES:
        for dst in ENGINES:
            if src != dst:
                res["pairs"][(src, dst)] = load_and_resave(
                    rank, world, dst, step_path(os.path.join(out, f"{src}-resumed"), K),
                    os.path.join(out, f"pair-{src}-{dst}"), out)
    res["timing"]["pairs"] = time.perf_counter() - t0
    res["from4"] = {dst: load_and_resave(rank, world, dst, four_ckpt, os.path.join(out, f"from4-{dst}"), out)
                    for dst in ENGINES}
    res["from4-train"] = {s: _continue_from(rank, world, s, four_ckpt, out, f"from4-train-{s}")
                          for s in ("ddp", "torch-fsdp")}
    # the uninterrupted run the SIGKILL test's killed run must equal: the same config through the same
    # loop at 2 ranks (bitwise what `shardlab train --nproc 2` trains, checked 2026-11-28), here in a
    # spawn that runs anyway rather than in three more interpreters of its own
    T.train(load_config(None, [*CLI_OVERRIDES, f"output.dir={out}", "output.run_name=straight"]),
            runtime(rank, world, "fsdp"))
    return res


@pytest.fixture(scope="module")
def two(tmp_path_factory, four):
    out = str(tmp_path_factory.mktemp("two"))
    # the spawn with the most work (and the SIGKILL test's reference run): its guard a little longer
    res = run_workers(2, _two, out, step_path(four["run"], K), (four["out"], four["corpus"]),
                      timeout_s=SPAWN_HANG_GUARD_S + 120)[0]
    return {"out": out, **res}


@pytest.mark.parametrize("strategy", ENGINES)
def test_exact_resume(two, strategy):
    r = two[strategy]
    assert r["steps_this_run"] == TOTAL - K
    assert r["resumed"] == r["straight"], "per-step losses differ after resume"
    out = two["out"]
    assert_same_tensors(step_path(f"{out}/{strategy}-straight", TOTAL), step_path(f"{out}/{strategy}-resumed", TOTAL))


def test_exact_resume_async_save(two):
    r = two["fsdp-async"]
    assert r["resumed"] == r["straight"]
    out = two["out"]
    assert_same_tensors(step_path(f"{out}/fsdp-async-straight", TOTAL), step_path(f"{out}/fsdp-async-resumed", TOTAL))


def test_cross_engine_load_keeps_params_and_optimizer_state(two):
    """Every engine loads every other engine's checkpoint: saving it again gives the same tensors."""
    for (src, _dst), resaved in two["pairs"].items():
        assert_same_tensors(step_path(f"{two['out']}/{src}-resumed", K), resaved)


def test_reshard_4_to_2(two, four):
    for _dst, resaved in two["from4"].items():
        assert_same_tensors(step_path(four["run"], K), resaved)
    for strategy, losses in two["from4-train"].items():
        _check_continuation(four, two["out"], f"from4-train-{strategy}", losses)


# ---------------------------------------------------------------------------------- world size 3
def _three(rank: int, world: int, out: str, four_ckpt: str, elastic: tuple[str, str]) -> dict:
    return {"from4": {dst: load_and_resave(rank, world, dst, four_ckpt, os.path.join(out, f"from4-{dst}"), out)
                      for dst in ("fsdp", "zero3", "torch-fsdp")},
            "from4-train": {"fsdp": _continue_from(rank, world, "fsdp", four_ckpt, out, "from4-train-fsdp")},
            "elastic": elastic_cases.phase(rank, world, *elastic)}


@pytest.fixture(scope="module")
def three(tmp_path_factory, four, two):  # after `two`: the elastic cases go 4 -> 2 -> 3 ranks
    out = str(tmp_path_factory.mktemp("three"))
    res = run_workers(3, _three, out, step_path(four["run"], K), (four["out"], four["corpus"]), timeout_s=240)[0]
    return {"out": out, **res}


def test_reshard_4_to_3(four, three):
    for _dst, resaved in three["from4"].items():
        assert_same_tensors(step_path(four["run"], K), resaved)
    _check_continuation(four, three["out"], "from4-train-fsdp", three["from4-train"]["fsdp"])


@pytest.fixture(scope="module")
def uninterrupted(four, tmp_path_factory):
    return elastic_cases.reference(str(tmp_path_factory.mktemp("uninterrupted")), four["corpus"])


@pytest.mark.parametrize("kind", elastic_cases.KINDS)
@pytest.mark.parametrize("strategy", elastic_cases.ENGINES)
def test_elastic_4_2_3_equals_the_uninterrupted_run(four, three, uninterrupted, strategy, kind):
    elastic_cases.check(three["elastic"][(strategy, kind)], uninterrupted[kind], four["out"], strategy, kind)


# ---------------------------------------------------------------------------------- a torn save
def _killed_mid_save(rank: int, world: int, out: str) -> None:
    import torch.distributed.checkpoint.filesystem as fs

    if rank == 1:
        original = fs.FileSystemWriter.write_data

        def write_part_then_die(self, plan, planner):
            if "step_00000004" in str(self.path):
                with open(os.path.join(str(self.path), "__1_0.distcp"), "wb") as f:
                    f.write(b"half a shard")
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, plan, planner)

        fs.FileSystemWriter.write_data = write_part_then_die
    T.train(make_cfg("fsdp", out, "torn", NO_DROPOUT, "parallel.timeout_s=20", steps=6, every=2),
            runtime(rank, world, "fsdp"))


def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(2, _killed_mid_save, str(tmp_path), timeout_s=SPAWN_HANG_GUARD_S)
    message = str(info.value)
    assert "rank 1: no result (exit code -9)" in message
    # not a silent hang: rank 0 failed on its own (parallel.timeout_s=20), not killed by the hang guard
    assert "rank 0: CheckpointError: rank 0: saving checkpoint step 4 failed" in message and "still running" not in message
    print(f"\nrank 0 failed the save {time.monotonic() - t0:.1f} s after the spawn")
    root = tmp_path / "torn" / "checkpoints"
    assert (root / "step_00000004.tmp").is_dir()  # the torn save is there, and ignored:
    assert [s for s, _ in list_checkpoints(str(root))] == [2]
    # resume (in one process, another engine: a 2 -> 1 reshard too) from step 2, finish, clean up
    cfg = make_cfg("single", str(tmp_path), "after", NO_DROPOUT, f"checkpoint.dir={root}", steps=6, every=2)
    result = T.train(cfg, runtime(0, 1, "single"))
    assert result["steps_this_run"] == 4
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004", "step_00000006"]


# ---------------------------------------------------------------------------------- SIGKILL a worker
# The killed run: LAST steps, a checkpoint every EVERY; the first kill after a checkpoint chosen at
# random among those before the last, the second right after the last. (100 steps every 20 until
# 2026-11-28: the same four checkpoints with two and a half times the steps between them.)
LAST, EVERY = 40, 10
CLI_OVERRIDES = ["parallel.strategy=fsdp", "model.preset=gpt-nano", "model.dropout=0.1", "data.source=synthetic",
                 "data.seq_len=32", "data.synthetic_samples=512", f"train.steps={LAST}", "train.global_batch_size=8",
                 "train.micro_batch_size=2", "train.eval_batches=1", f"checkpoint.every_steps={EVERY}",
                 "output.tensorboard=false", "output.progress=false", "parallel.timeout_s=60"]


def _cli(out: str, name: str) -> list[str]:
    return [sys.executable, "-m", "shardlab", "train", "--nproc", "2", "--max-restarts", "2",
            *CLI_OVERRIDES, f"output.dir={out}", f"output.run_name={name}"]


def _worker_pids(agent_pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent_pid and b"shardlab" in cmd and b"train" in cmd:
            pids.append(int(entry))
    return sorted(pids)


@pytest.mark.timeout(3 * HANG_GUARD_S)   # the suite's pytest-timeout, 300 s, would be a speed budget here
def test_sigkill_worker_restarts_and_matches_uninterrupted(tmp_path, two):
    """Two kills: one after a checkpoint at a random step, one right after the final save
    (the restarted workers resume at the last step and must finish cleanly with nothing to
    train). Each kill costs exactly one restart; the result equals an uninterrupted run (trained
    in the 2-rank spawn, `_two`)."""
    out = str(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    first = random.Random().choice(range(EVERY, LAST, EVERY))  # a fresh seed each run; printed on failure
    log = open(tmp_path / "killed.log", "w")
    agent = subprocess.Popen(_cli(out, "killed"), stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    kills: list[int] = []
    try:
        root = tmp_path / "killed" / "checkpoints"
        for target in (first, LAST):
            deadline = time.monotonic() + HANG_GUARD_S
            while (not list_checkpoints(str(root)) or list_checkpoints(str(root))[-1][0] < target) \
                    and agent.poll() is None:
                assert time.monotonic() < deadline, f"hang guard: no checkpoint {target} after {HANG_GUARD_S} s"
                time.sleep(0.01)
            workers = _worker_pids(agent.pid)
            if target == LAST and (agent.poll() is not None or len(workers) < 2):
                break  # the run ended before the second kill could land: counted below
            assert len(workers) == 2 and agent.poll() is None, f"no running workers to kill at step {target}"
            os.kill(workers[-1], signal.SIGKILL)
            kills.append(list_checkpoints(str(root))[-1][0])
        assert agent.wait(timeout=HANG_GUARD_S) == 0, f"kills after {kills}: " + (tmp_path / "killed.log").read_text()[-3000:]
    finally:
        if agent.poll() is None:  # the agent starts workers in their own sessions: kill them first
            for pid in _worker_pids(agent.pid):
                os.kill(pid, signal.SIGKILL)
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        log.close()
    metrics = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    args = json.loads((tmp_path / "killed" / "run_args.json").read_text())
    # a kill once the last step's metrics.json was written: the next group found the run finished and
    # rewrote nothing ([Note: records stay true] in loop/run_summary.py), so the record is the killed group's
    late = len(kills) == 2 and kills[1] == LAST and metrics["steps_this_run"] > 0
    # exactly one restart per kill: each attempt has its own store keys (runtime.py's
    # [Note: one key space per restart]), so the new group never dials the dead one's addresses
    assert metrics["restart_count"] == len(kills) - late, f"kills after steps {kills}"
    # the survivors of the first kill said so, in their stderr files (torch's LogsSpecs, launcher.py)
    first_attempt = (tmp_path / "killed" / "debug" / "workers").glob("*/attempt_0/*/stderr.log")
    assert any("lost contact with another worker" in p.read_text() for p in first_attempt)
    assert 0 < kills[0] < LAST and metrics["steps_this_run"] < LAST
    if len(kills) == 2 and kills[1] == LAST and not late:  # killed before its metrics.json: the next group,
        assert metrics["steps_this_run"] == 0 and metrics["samples_per_s"] is None  # resumed at the end, wrote it
    assert [a["attempt"] for a in metrics["attempts"]] == list(range(len(kills) + 1 - late))
    assert metrics["attempts"][-1]["steps_to"] == LAST
    assert json.dumps(args).count("resumed_from_step") == 1
    straight = os.path.join(two["out"], "straight")
    with open(os.path.join(straight, "metrics.json")) as f:
        assert metrics["losses"] == json.load(f)["losses"]
    assert_same_tensors(step_path(straight, LAST), step_path(f"{out}/killed", LAST))
    # a kill at the final checkpoint can land after both ranks closed their records as finished: that
    # attempt reads finished, and rightly (one failure beside two CPU hogs, 3 attempts read back and one
    # of the first two neither failed nor lost, fits this; the states are in the message now)
    _observed_attempts(tmp_path / "killed", len(kills) + 1, finished_ok={1} if kills[-1] == LAST else set())


def _observed_attempts(run_dir, count: int, finished_ok: set[int]) -> None:
    """`shardlab trace` and `report` of the killed run (tests/test_observe.py's runs are not restarted):
    every attempt read back from debug/; a killed one failed or lost (whether the survivor wrote its exit
    record before the agent stopped it is a race), or finished where its kill came after its last step
    (`finished_ok`), the last finished; one track per rank and attempt."""
    attempts = read_run(str(run_dir)).attempts
    now = time.time()
    assert [a.attempt for a in attempts] == list(range(count))
    states = [(a.state(now), {r: (f.state, f.step) for r, f in a.flights.items()}) for a in attempts]
    assert all(s in ("failed", "lost") or (s == "finished" and i in finished_ok)
               for i, (s, _) in enumerate(states[:-1])), states
    assert states[-1][0] == "finished", states
    trace = build_trace(str(run_dir))
    assert [a["attempt"] for a in trace["otherData"]["attempts"]] == list(range(count))
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert all(any(f"attempt {i}" in t for t in tracks) for i in range(count)), tracks
    assert nested(trace["traceEvents"])
    ends = {e["name"] for e in trace["traceEvents"] if e["ph"] == "i"}
    assert {"attempt 0: failed", "attempt 0: lost"} & ends and f"attempt {count - 1}: finished" in ends
    pytest.importorskip("matplotlib", reason="shardlab report draws with matplotlib (shardlab[plot])")
    text = build_report(str(run_dir))
    assert all(f" attempt {i}" in text for i in range(count))
    for a in attempts[:-1]:  # a failed attempt's exit records are shown, a lost one has none
        assert (f"{a.label}: rank " in text) == (a.state(now) == "failed"), a.label
