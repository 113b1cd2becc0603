"""`shardlab.testing.run_workers`, which every multi-process test stands on: workers forked from a
forkserver see the parent's environment as it is when they start, not as it was when the server
started ([Note: workers from a forkserver] in src/shardlab/testing.py); a run naming plugins spawns."""

from __future__ import annotations

import os

import pytest

from shardlab.testing import WorkerError, run_workers


def _environment_and_parent(rank: int, world: int) -> tuple[str | None, int, int]:
    import torch.distributed as dist

    return os.environ.get("SHARDLAB_TEST_MARK"), os.getppid(), dist.get_world_size()


def _fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted on rank 1")
    return rank


def test_workers_see_the_environment_of_the_call_and_fail_by_rank(monkeypatch):
    monkeypatch.setenv("SHARDLAB_TEST_MARK", "first")
    assert [r[0] for r in run_workers(2, _environment_and_parent)] == ["first", "first"]
    monkeypatch.setenv("SHARDLAB_TEST_MARK", "second")  # after the forkserver started
    results = run_workers(2, _environment_and_parent)
    assert [r[0] for r in results] == ["second", "second"]
    assert [r[2] for r in results] == [2, 2]
    if os.uname().sysname == "Linux":  # forked by the server, not by this process
        assert all(r[1] != os.getpid() for r in results)
    with pytest.raises(WorkerError, match="rank 1: ValueError: planted on rank 1"):
        run_workers(2, _fail_on_rank_one)


def test_a_run_naming_plugins_spawns_its_workers(monkeypatch):
    monkeypatch.setenv("SHARDLAB_PLUGINS", "tests.toys")
    monkeypatch.setenv("SHARDLAB_TEST_MARK", "plugins")
    results = run_workers(1, _environment_and_parent)
    assert results == [("plugins", os.getpid(), 1)]
