"""A real two-host run: two network namespaces joined by a veth pair are the two hosts.
Each runs one torchrun agent; they rendezvous over TCP (c10d) on the private link and train
together. The result must equal a single-host 2-worker run.

Only the two addresses below (on a link that exists only between the two namespaces) and
loopback carry traffic: the namespaces have no route anywhere else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.net_listeners import listeners_of, process_tree

pytestmark = [pytest.mark.infra, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
HOST_A, HOST_B = "10.213.7.1", "10.213.7.2"
PREFIX = 30                      # a /30: exactly these two addresses
RDZV_PORT = 29641
RUN_TIMEOUT_S = 240
TRAIN_ARGS = ["model.preset=gpt-nano", "data.seq_len=32", "train.steps=4", "output.progress=false",
              "output.tensorboard=false"]


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    proc = subprocess.run(["bash", str(ROOT / "infra" / "apt-install.sh"), "ip=iproute2"], capture_output=True,
                          text=True, timeout=400)
    if proc.returncode != 0 or shutil.which("ip") is None:
        pytest.skip(f"iproute2 (ip) is not available: {proc.stderr.strip()}")
    tag = str(os.getpid() % 100000)
    ns = (f"shl-a-{tag}", f"shl-b-{tag}")
    veth = (f"shla{tag}", f"shlb{tag}")
    try:
        for n in ns:
            sh("ip", "netns", "add", n)
        sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for n, v, addr in zip(ns, veth, (HOST_A, HOST_B)):
            sh("ip", "link", "set", v, "netns", n)
            sh("ip", "-n", n, "addr", "add", f"{addr}/{PREFIX}", "dev", v)
            sh("ip", "-n", n, "link", "set", v, "up")
            sh("ip", "-n", n, "link", "set", "lo", "up")
        ping = subprocess.run(["ip", "netns", "exec", ns[1], "ping", "-c", "1", "-W", "2", HOST_A],
                              capture_output=True, timeout=10)
        if ping.returncode not in (0, 127) and shutil.which("ping"):
            pytest.fail(f"the veth link does not carry traffic: {ping.stderr!r}")
    except subprocess.CalledProcessError as e:
        _cleanup(ns, veth)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    try:
        yield list(zip(ns, veth, (HOST_A, HOST_B)))
    finally:
        _cleanup(ns, veth)


def _cleanup(ns, veth) -> None:
    for n in ns:
        # processes left inside would keep the namespace alive
        pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True, timeout=10).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=10)
    subprocess.run(["ip", "link", "del", veth[0]], capture_output=True, timeout=10)   # if never moved


def _metrics(run_dirs: list[Path]) -> dict:
    found = [d / "metrics.json" for d in run_dirs if (d / "metrics.json").exists()]
    assert found, f"no metrics.json under {run_dirs}"
    return json.loads(found[0].read_text())


def test_two_namespaces_train_together(two_hosts, tmp_path):
    config = str(ROOT / "configs" / "gpt-tiny.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs, seen = [], [set(), set()]
    for i, (ns, veth, addr) in enumerate(two_hosts):
        cmd = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={veth}",
               sys.executable, "-m", "shardlab.torchrun",
               "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={HOST_A}:{RDZV_PORT}", "--rdzv-id=netns-test",
               # host A serves the rendezvous store; say so rather than have torch guess from
               # a hostname both namespaces share
               f"--rdzv-conf=is_host={1 if i == 0 else 0}", f"--local-addr={addr}", "--max-restarts=0",
               "-m", "shardlab", "train", config, *TRAIN_ARGS,
               f"output.dir={tmp_path / f'host{i}'}", "output.run_name=netns"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=ROOT))
    outputs = []
    try:
        # each host's listeners while the run goes on (the hang guard is communicate's timeout below)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                seen[i] |= listeners_of(process_tree(p.pid))
            time.sleep(0.05)
        for p in procs:
            outputs.append(p.communicate(timeout=RUN_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two-host run did not finish in time:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    # each host listens on its own address on the link (the stores, gloo) or on loopback, never on all
    for (_, _, addr), listening in zip(two_hosts, seen):
        assert listening, "no listener seen: the sampling missed the run"
        assert {a for a, _ in listening} <= {addr, "127.0.0.1"}, listening
    assert (HOST_A, RDZV_PORT) in seen[0]
    multi = _metrics([tmp_path / "host0" / "netns", tmp_path / "host1" / "netns"])
    assert multi["world_size"] == 2

    single_dir = tmp_path / "single"
    ref = subprocess.run([sys.executable, "-m", "shardlab", "train", config, *TRAIN_ARGS, f"output.dir={single_dir}",
                          "output.run_name=ref", "--nproc", "2"], capture_output=True, text=True, env=env,
                         timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    single = _metrics([single_dir / "ref"])
    assert single["world_size"] == 2
    assert len(multi["losses"]) == len(single["losses"]) == 4
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)


def test_a_one_host_run_cannot_be_reached_from_another_host(two_hosts, tmp_path):
    """The open door of issue 42: a `--nproc` run on host A listened on every interface, and a
    client on another host could write the rendezvous state torch unpickles. Host B now finds
    nothing of the run at host A's address: every port the run listens on is refused there. A
    listener of host A's own on every interface, reached from B, shows the probe can see one."""
    (ns_a, _, _), (ns_b, _, _) = two_hosts
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    control = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-c",
                                "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 29642)); s.listen(); "
                                "time.sleep(600)"])
    run = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-m", "shardlab", "train",
                            str(ROOT / "configs" / "gpt-tiny.yaml"), *TRAIN_ARGS, "train.steps=8", "--nproc", "2",
                            f"output.dir={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, cwd=ROOT)
    ports: set[int] = set()
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while run.poll() is None and time.monotonic() < deadline:
            found = listeners_of(process_tree(run.pid))
            new = {port for _, port in found} - ports
            ports |= new
            if new:   # probe while the run is alive: from host B, at host A's address
                probe = subprocess.run(
                    ["ip", "netns", "exec", ns_b, sys.executable, "-c", _PROBE, HOST_A, *map(str, sorted(ports))],
                    capture_output=True, text=True, timeout=60)
                assert probe.stdout.split() == ["refused"] * len(ports), (ports, probe.stdout, probe.stderr)
            time.sleep(0.05)
        out = run.communicate(timeout=RUN_TIMEOUT_S)[0]
        assert run.returncode == 0, out[-3000:]
        assert len(ports) >= 2, f"only {ports} seen listening: the sampling missed the run's stores"
        probe = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, "-c", _PROBE, HOST_A, "29642"],
                               capture_output=True, text=True, timeout=60)
        assert probe.stdout.split() == ["reached"], probe
    finally:
        for p in (run, control):
            p.kill()
            p.wait()


_PROBE = """
import socket, sys
for port in sys.argv[2:]:
    try:
        socket.create_connection((sys.argv[1], int(port)), timeout=5).close()
        print("reached")
    except OSError:
        print("refused")
"""
