"""Nothing a one-host run opens listens beyond loopback ([Note: who may reach a run's stores] in
loop/listen.py, docs/security.md): checked on the live process tree of each way of starting one,
and on the pieces that bind; a multi-node start without a rendezvous id is refused. The same from
another host (a network namespace) is in test_infra_multihost.py."""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

import pytest

from shardlab.loop import listen
from tests.cli_batch import Command, run_commands
from tests.net_listeners import listeners_of, run_watching_listeners

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "gpt-tiny.yaml")
TRAIN_ARGS = ["model.preset=gpt-nano", "data.seq_len=32", "train.steps=4", "output.progress=false",
              "output.tensorboard=false"]
HANG_GUARD_S = 600   # a hang guard only: these runs take seconds on an idle machine


def _not_loopback(seen: set[tuple[str, int]]) -> list[tuple[str, int]]:
    return sorted(a for a in seen if not ipaddress.ip_address(a[0]).is_loopback)


def _launches(tmp_path: Path, port: int) -> dict[str, list[str]]:
    shardlab = [sys.executable, "-m", "shardlab", "train", CONFIG, *TRAIN_ARGS]
    torchrun = [sys.executable, "-m", "shardlab.torchrun"]
    return {
        "nproc": [*shardlab, "--nproc", "2", f"output.dir={tmp_path / 'a'}"],
        "nnodes-loopback-endpoint": [*shardlab, "--nproc", "1", "--nnodes", "1:2", "--rdzv-endpoint",
                                     f"127.0.0.1:{port}", "--rdzv-id", "security-test", f"output.dir={tmp_path / 'b'}"],
        "torchrun-standalone": [*torchrun, "--nproc-per-node", "2", "-m", "shardlab", "train", CONFIG, *TRAIN_ARGS,
                                f"output.dir={tmp_path / 'c'}"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("how", ["nproc", "nnodes-loopback-endpoint", "torchrun-standalone"])
def test_a_one_host_run_listens_on_loopback_only(how, tmp_path):
    from shardlab.loop.runtime import free_port

    cmd = _launches(tmp_path, free_port())[how]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done, seen = run_watching_listeners(cmd, HANG_GUARD_S, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:]
    # the rendezvous store, the workers' store and gloo's sockets: at least the two stores were seen
    assert len(seen) >= 2, f"the sampling saw only {seen}: the run may have been too quick to watch"
    assert not _not_loopback(seen), f"{how}: listening beyond loopback: {_not_loopback(seen)}"


def test_store_server_listens_on_the_address_it_is_given():
    import datetime

    store = listen.store_server(listen.LOOPBACK, 0, timeout=datetime.timedelta(seconds=30))
    mine = listeners_of({os.getpid()})
    assert (listen.LOOPBACK, store.port) in mine
    assert all(addr == listen.LOOPBACK for addr, port in mine if port == store.port)
    # and a client reaches it there
    import torch.distributed as dist

    client = dist.TCPStore(listen.LOOPBACK, store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize("host, expect", [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"),
                                          ("127.0.0.5", "127.0.0.5")])
def test_a_loopback_endpoint_listens_on_loopback(host, expect):
    assert listen.listen_address(host) == expect


def test_a_name_that_resolves_to_loopback_is_not_written_as_loopback():
    # a Debian host's own name resolves to 127.0.1.1: other hosts do not reach that
    assert listen.is_loopback_name("localhost") and listen.is_loopback_name("127.0.1.1")
    assert not listen.is_loopback_name("node-1.example")


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """The two refusals below, each a process of its own forked from one interpreter that imported
    torch once (tests/cli_batch.py); the output directory the first must not create."""
    out = tmp_path_factory.mktemp("refused")
    agent, torchrun = run_commands([
        Command(["train", CONFIG, *TRAIN_ARGS, "--nproc", "1", "--nnodes", "1:2", f"output.dir={out}"], cwd=ROOT),
        Command(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
                 "-m", "shardlab", "train", CONFIG], module="shardlab.torchrun", cwd=ROOT)], timeout_s=HANG_GUARD_S)
    return {"out": out, "agent": agent, "torchrun": torchrun}


def test_an_elastic_agent_needs_a_rendezvous_id(refusals):
    out = refusals["agent"]
    assert out.returncode == 2
    assert out.stderr.startswith("error: --nnodes 1:2 needs --rdzv-id"), out.stderr
    assert not refusals["out"].joinpath("gpt-fsdp").exists()


def test_torchrun_multi_node_without_an_id_is_refused(refusals):
    out = refusals["torchrun"]
    assert out.returncode != 0
    assert "needs --rdzv-id" in out.stderr and "Traceback" not in out.stderr, out.stderr
