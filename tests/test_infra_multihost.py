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
from pathlib import Path

import pytest

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
    procs = []
    for i, (ns, veth, addr) in enumerate(two_hosts):
        cmd = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={veth}",
               sys.executable, "-m", "torch.distributed.run",
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
        for p in procs:
            outputs.append(p.communicate(timeout=RUN_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two-host run did not finish in time:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
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
