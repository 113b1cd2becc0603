"""What TCP sockets a process tree listens on, read from Linux's /proc (what `ss -ltnp` shows),
sampled while a run goes on: the listener checks of test_security.py and test_infra_multihost.py."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import tempfile
import time


def process_tree(root: int) -> set[int]:
    """`root` and every process below it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= below
        grew = bool(below)
    return tree


def listeners_of(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that `pids` hold."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        # the tables are per network namespace: /proc/<pid>/net of one of the pids reads theirs
        path = f"/proc/{min(pids)}/net/{os.path.basename(table)}" if pids else table
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:   # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def run_watching_listeners(cmd: list[str], timeout_s: float, **popen) -> tuple[subprocess.CompletedProcess,
                                                                                 set[tuple[str, int]]]:
    """Run `cmd` to the end, sampling its process tree's listeners every 50 ms; `timeout_s` is a
    hang guard."""
    with tempfile.TemporaryFile("w+") as log:   # a file, not a pipe: nothing blocks while we sample
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, **popen)
        seen: set[tuple[str, int]] = set()
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.seek(0)
                raise AssertionError(f"hang guard: {cmd} still running after {timeout_s} s:\n{log.read()[-3000:]}")
            seen |= listeners_of(process_tree(proc.pid))
            time.sleep(0.05)
        log.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, log.read(), ""), seen
